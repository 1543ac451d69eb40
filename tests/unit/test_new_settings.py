"""Settings this round added refuse what cannot work (a setting is an entry point too)."""

import pytest
from pydantic import ValidationError

from inferscale.core.settings import Settings


@pytest.mark.parametrize(("name", "raw"), [
    ("INFERSCALE_EXPIRE_INTERVAL_S", "0"), ("INFERSCALE_EXPIRE_INTERVAL_S", "-5"),
    ("INFERSCALE_EXPIRE_INTERVAL_S", "nan"), ("INFERSCALE_EXPIRE_INTERVAL_S", "inf"),
    ("INFERSCALE_EXPIRE_INTERVAL_S", "soon"), ("INFERSCALE_CHANGES_TOPIC", ""),
    ("INFERSCALE_PINNED_MAX", "-1"), ("INFERSCALE_PINNED_MAX", "257"),
    ("INFERSCALE_PINNED_MAX", "many"), ("INFERSCALE_CHANGES_WITH_TEXT", "perhaps"),
    ("INFERSCALE_MAX_WAITS_PER_KEY", "0"), ("INFERSCALE_FILTER_INLINE_COST", "-1"),
    ("INFERSCALE_FILTER_MAX_COST", "0"), ("INFERSCALE_METRICS_ACCESS", "everyone"),
    ("INFERSCALE_VLLM_KEYS_FOR_MEMORY", "maybe"), ("INFERSCALE_WORKER_HTTP_HOST", ""),
    ("INFERSCALE_RATE_LIMIT_STORAGE", "ftp://x"),
    ("INFERSCALE_RECOMPUTE_AUTO_DIRECT_MARGIN", "-0.1"),
    ("INFERSCALE_RECOMPUTE_AUTO_DIRECT_MARGIN", "nan"),
    ("INFERSCALE_RECOMPUTE_AUTO_DIRECT_MARGIN", "inf"),
    ("INFERSCALE_RECOMPUTE_AUTO_DIRECT_MARGIN", "low"),
    ("INFERSCALE_RECORD_CONVERSATIONS", "sometimes"),
    ("INFERSCALE_RECORD_OUTBOX_TURNS", "0"), ("INFERSCALE_RECORD_OUTBOX_TURNS", "-1"),
    ("INFERSCALE_RECORD_OUTBOX_TURNS", "lots"), ("INFERSCALE_RECORD_DRAIN_S", "-1"),
    ("INFERSCALE_RECORD_DRAIN_S", "nan"), ("INFERSCALE_RECORD_DRAIN_S", "inf")])
def test_the_new_settings_refuse_nonsense(monkeypatch, name, raw):
    monkeypatch.setenv(name, raw)
    with pytest.raises(ValidationError):
        Settings()


def test_the_new_settings_take_what_they_document(monkeypatch):
    monkeypatch.setenv("INFERSCALE_PINNED_MAX", "0")
    monkeypatch.setenv("INFERSCALE_CHANGES_WITH_TEXT", "true")
    settings = Settings()
    assert settings.pinned_max == 0 and settings.changes_with_text is True
    assert Settings.model_fields["pinned_max"].default == 16
    assert Settings.model_fields["changes_with_text"].default is False
    monkeypatch.setenv("INFERSCALE_METRICS_ACCESS", "admin")
    monkeypatch.setenv("INFERSCALE_RATE_LIMIT_STORAGE", "redis://127.0.0.1:6379")
    settings = Settings()
    assert settings.metrics_access == "admin" and settings.rate_limit_storage.startswith("redis")
    defaults = Settings.model_fields
    assert defaults["metrics_access"].default == "loopback"
    assert defaults["vllm_keys_for_memory"].default is False
    assert defaults["worker_http_host"].default == "127.0.0.1"



def test_recording_and_the_direct_step_are_off_unless_asked(monkeypatch):
    defaults = Settings.model_fields
    assert defaults["record_conversations"].default is False
    assert defaults["recompute_auto_direct_margin"].default == 0.0
    monkeypatch.setenv("INFERSCALE_RECORD_CONVERSATIONS", "true")
    monkeypatch.setenv("INFERSCALE_RECOMPUTE_AUTO_DIRECT_MARGIN", "0.375")
    settings = Settings()
    assert settings.record_conversations is True
    assert settings.recompute_auto_direct_margin == 0.375


def test_the_outbox_settings_take_what_they_document(monkeypatch):
    monkeypatch.setenv("INFERSCALE_RECORD_OUTBOX_TURNS", "1")
    monkeypatch.setenv("INFERSCALE_RECORD_DRAIN_S", "0")
    settings = Settings()
    assert settings.record_outbox_turns == 1 and settings.record_drain_s == 0
