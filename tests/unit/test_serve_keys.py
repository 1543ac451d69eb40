"""Which keys a server accepts (``serve.memory_keys``): the configured ones, else vLLM's own
where the operator chose them, else the local admin key; anonymous only where chosen, whatever
address the server listens on or what vLLM arguments it gets."""

import pytest

from inferscale.core.local_key import key_path, read_key
from inferscale.core.settings import Settings
from inferscale.serving.serve import api_keys_in, memory_keys, without_api_keys


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0", "::", "localhost"])
def test_a_server_without_keys_makes_and_keeps_a_local_admin_key(tmp_path, host):
    settings = Settings(data_dir=tmp_path, server_host=host)
    keys = memory_keys(settings, [])
    (key, grant), = keys.items()
    assert grant.admin and key == read_key(tmp_path)
    assert key_path(tmp_path).stat().st_mode & 0o077 == 0
    assert memory_keys(settings, []) == keys  # the same key on the next start


def test_configured_keys_win_and_vllm_keys_are_memory_keys_only_where_chosen(tmp_path):
    configured = Settings(data_dir=tmp_path, api_keys={"k": ["alice"]})
    assert list(memory_keys(configured, ["vllm-key"])) == ["k"]
    chosen = Settings(data_dir=tmp_path, vllm_keys_for_memory=True)
    vllm_only = memory_keys(chosen, api_keys_in(["--api-key", "vk"]))
    assert list(vllm_only) == ["vk"] and vllm_only["vk"].admin
    assert not key_path(tmp_path).exists()  # no local key where keys were given


def test_a_generation_key_reads_no_memory_by_default(tmp_path):
    keys = memory_keys(Settings(data_dir=tmp_path), ["vk"])
    assert "vk" not in keys and list(keys) == [read_key(tmp_path)]


def test_vllm_keys_leave_vllms_command_line():
    assert without_api_keys(["--api-key", "a", "b", "--port", "1", "--api-key=c", "--x"]) == [
        "--port", "1", "--x"]
    assert without_api_keys(["--host", "0.0.0.0"]) == ["--host", "0.0.0.0"]


def test_anonymous_only_where_chosen(tmp_path):
    assert memory_keys(Settings(data_dir=tmp_path, allow_anonymous=True), []) == {}
    assert not key_path(tmp_path).exists()


def test_vllm_key_arguments_are_read_in_every_form():
    assert api_keys_in(["--api-key", "a", "b", "--port", "1", "--api-key=c"]) == ["a", "b", "c"]
    assert api_keys_in(["--host", "0.0.0.0"]) == []
