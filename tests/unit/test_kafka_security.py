"""Kafka client security: the settings refuse inconsistent combinations, ``kafka_security`` maps
them onto aiokafka's keyword arguments, every client kind accepts those, and child processes get
the password itself."""

import os
import ssl

import certifi
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from pydantic import ValidationError

from inferscale.core.settings import Settings, settings_env
from inferscale.pipeline.kafka import kafka_security

SCRAM = {"kafka_security_protocol": "SASL_PLAINTEXT", "kafka_sasl_mechanism": "SCRAM-SHA-512",
         "kafka_sasl_username": "inferscale", "kafka_sasl_password": "s3cret"}


@pytest.fixture(autouse=True)
def _no_kafka_env(monkeypatch):
    for name in [n for n in os.environ if n.startswith("INFERSCALE_KAFKA_")]:
        monkeypatch.delenv(name)


def test_plaintext_by_default_adds_nothing():
    assert kafka_security(Settings()) == {}


def test_sasl_maps_onto_aiokafka_and_hides_the_password():
    settings = Settings(**SCRAM)
    assert kafka_security(settings) == {
        "security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_plain_username": "inferscale", "sasl_plain_password": "s3cret"}
    assert "s3cret" not in repr(settings) and "s3cret" not in str(settings.model_dump())


def test_sasl_ssl_verifies_the_broker_with_the_system_cas_by_default():
    options = kafka_security(Settings(**{**SCRAM, "kafka_security_protocol": "SASL_SSL"}))
    context = options.pop("ssl_context")
    assert options["security_protocol"] == "SASL_SSL" and options["sasl_plain_password"]
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname


def test_a_ca_file_is_loaded():
    context = kafka_security(Settings(kafka_security_protocol="SSL",
                                      kafka_ssl_cafile=certifi.where()))["ssl_context"]
    assert context.get_ca_certs() and context.verify_mode == ssl.CERT_REQUIRED


@pytest.mark.parametrize("missing", ["kafka_sasl_mechanism", "kafka_sasl_username",
                                     "kafka_sasl_password"])
@pytest.mark.parametrize("protocol", ["SASL_PLAINTEXT", "SASL_SSL"])
def test_a_sasl_protocol_needs_mechanism_user_and_password(protocol, missing):
    with pytest.raises(ValidationError, match=f"{protocol} needs {missing}"):
        Settings(**{**SCRAM, "kafka_security_protocol": protocol, missing: None})
    with pytest.raises(ValidationError, match=missing):  # empty (an unset variable) too
        Settings(**{**SCRAM, "kafka_security_protocol": protocol, missing: ""})


def test_the_environment_is_checked_the_same_way(monkeypatch):
    monkeypatch.setenv("INFERSCALE_KAFKA_SECURITY_PROTOCOL", "SASL_SSL")
    monkeypatch.setenv("INFERSCALE_KAFKA_SASL_MECHANISM", "SCRAM-SHA-256")
    monkeypatch.setenv("INFERSCALE_KAFKA_SASL_USERNAME", "inferscale")
    with pytest.raises(ValidationError, match="needs kafka_sasl_password"):
        Settings()
    monkeypatch.setenv("INFERSCALE_KAFKA_SASL_PASSWORD", "s3cret")
    assert kafka_security(Settings())["sasl_plain_password"] == "s3cret"


@pytest.mark.parametrize("field, value", [
    ("kafka_security_protocol", "TLS"), ("kafka_security_protocol", "sasl_plaintext"),
    ("kafka_sasl_mechanism", "SCRAM-SHA-1"), ("kafka_sasl_mechanism", "GSSAPI"),
    ("kafka_sasl_mechanism", "scram-sha-512")])
def test_unknown_protocols_and_mechanisms_are_refused(field, value):
    with pytest.raises(ValidationError, match=field):
        Settings(**{**SCRAM, field: value})


@pytest.mark.parametrize("protocol", ["PLAINTEXT", "SSL"])
@pytest.mark.parametrize("field", ["kafka_sasl_mechanism", "kafka_sasl_username",
                                   "kafka_sasl_password"])
def test_sasl_settings_without_a_sasl_protocol_are_refused(protocol, field):
    with pytest.raises(ValidationError, match=f"{field} need kafka_security_protocol SASL_"):
        Settings(**{"kafka_security_protocol": protocol, field: SCRAM[field]})


@pytest.mark.parametrize("protocol", ["PLAINTEXT", "SASL_PLAINTEXT"])
def test_tls_files_without_tls_are_refused(protocol, tmp_path):
    settings = SCRAM if protocol.startswith("SASL_") else {}
    with pytest.raises(ValidationError, match="kafka_ssl_cafile need kafka_security_protocol SSL"):
        Settings(**{**settings, "kafka_security_protocol": protocol,
                    "kafka_ssl_cafile": tmp_path / "ca.pem"})


def test_a_key_without_its_certificate_is_refused(tmp_path):
    with pytest.raises(ValidationError, match="kafka_ssl_keyfile needs kafka_ssl_certfile"):
        Settings(kafka_security_protocol="SSL", kafka_ssl_keyfile=tmp_path / "client.key")


@pytest.mark.parametrize("field", ["kafka_ssl_cafile", "kafka_ssl_certfile"])
def test_missing_or_broken_tls_files_fail_with_the_settings_names(field, tmp_path):
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    for path in (tmp_path / "absent.pem", garbage):
        settings = Settings(kafka_security_protocol="SSL", **{field: path})
        with pytest.raises(ValueError, match="cannot load kafka_ssl_cafile"):
            kafka_security(settings)


def test_children_get_the_password_itself():
    settings = Settings(**SCRAM)
    assert settings.model_dump(mode="json")["kafka_sasl_password"] == "**********"
    env = settings_env(settings)
    assert env["INFERSCALE_KAFKA_SASL_PASSWORD"] == "s3cret"
    assert env["INFERSCALE_KAFKA_SECURITY_PROTOCOL"] == "SASL_PLAINTEXT"
    assert "INFERSCALE_KAFKA_SSL_CAFILE" not in env


async def test_every_client_kind_accepts_the_options():
    """The names are aiokafka's: an admin client, a producer and a consumer take them (built,
    not started: no broker needed)."""
    options = kafka_security(Settings(**{**SCRAM, "kafka_security_protocol": "SASL_SSL"}))
    admin = AIOKafkaAdminClient(bootstrap_servers="127.0.0.1:1", **options)
    producer = AIOKafkaProducer(bootstrap_servers="127.0.0.1:1", **options)
    consumer = AIOKafkaConsumer(bootstrap_servers="127.0.0.1:1", **options)
    for client in (admin._client, producer.client, consumer._client):
        assert client._security_protocol == "SASL_SSL"
        assert client._sasl_mechanism == "SCRAM-SHA-512"
        assert client._sasl_plain_password == "s3cret"
        assert client._ssl_context is options["ssl_context"]
    await producer.stop()
    await consumer.stop()
    await admin.close()
