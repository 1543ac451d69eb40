"""The embedded database's URL (``core/endpoints.py``): it carries the password kept in the
infra folder, quoted, so every process of the stack logs in with it."""

import pytest
from sqlalchemy.engine import make_url

from inferscale.core.endpoints import endpoints, pg_password_path, postgres_url, read_pg_password
from inferscale.core.settings import Settings


@pytest.mark.parametrize("password", ["pyW4C8moI9kHDqz5_-", "p@ss:w/rd?#%", "späce word"])
def test_the_password_goes_into_the_url_quoted(password):
    url = make_url(postgres_url(5432, password))
    assert (url.drivername, url.username, url.host, url.port, url.database) == (
        "postgresql+asyncpg", "postgres", "127.0.0.1", 5432, "inferscale")
    assert url.password == password


def test_no_password_no_login_part():
    assert postgres_url(5432, None) == "postgresql+asyncpg://postgres@127.0.0.1:5432/inferscale"


def test_endpoints_read_the_password_file(tmp_path):
    settings = Settings(data_dir=tmp_path)
    state = {"kafka": {"port": 9092}, "postgres": {"port": 5432}}
    assert read_pg_password(settings) is None
    assert make_url(endpoints(settings, state).database_url).password is None
    settings.infra_dir.mkdir()
    pg_password_path(settings).write_text("s3cret\n")
    found = endpoints(settings, state)
    assert found.kafka_bootstrap == "127.0.0.1:9092"
    assert make_url(found.database_url).password == "s3cret"
