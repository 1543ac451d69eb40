"""Settings this round added refuse what cannot work (a setting is an entry point too)."""

import pytest
from pydantic import ValidationError

from inferscale.core.settings import Settings


@pytest.mark.parametrize(("name", "raw"), [
    ("INFERSCALE_EXPIRE_INTERVAL_S", "0"), ("INFERSCALE_EXPIRE_INTERVAL_S", "-5"),
    ("INFERSCALE_EXPIRE_INTERVAL_S", "nan"), ("INFERSCALE_EXPIRE_INTERVAL_S", "inf"),
    ("INFERSCALE_EXPIRE_INTERVAL_S", "soon"), ("INFERSCALE_CHANGES_TOPIC", "")])
def test_the_new_settings_refuse_nonsense(monkeypatch, name, raw):
    monkeypatch.setenv(name, raw)
    with pytest.raises(ValidationError):
        Settings()
