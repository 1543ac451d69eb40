"""Key scales: the file format, the setting, hostile files, and the scaling rule."""

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from hostile import json_values, tried
from inferscale.key_scales import (
    MAX_FILE_BYTES,
    SHIPPED_DIR,
    KeyScalesError,
    key_factor,
    load_key_scales,
    parse_key_scales,
    resolve_for_server,
    resolve_key_scales,
)
from inferscale.settings import Settings


def test_a_valid_file_parses_and_bad_ones_say_why(tmp_path):
    good = parse_key_scales({"model": "m", "scales": [0.5, 1, 2.0]}, 3, "f")
    assert good.scales == (0.5, 1.0, 2.0) and good.source == "f"
    assert good.tensor().dtype == torch.float32
    for raw, why in (([1.0], "object"), ({"scales": "1,1"}, "object"),
                     ({"scales": [1.0, 1.0]}, "2 scales for a model with 3 layers"),
                     ({"scales": [1.0, 1.0, True]}, "number"),
                     ({"scales": [1.0, 1.0, None]}, "number"),
                     ({"scales": [1.0, 1.0, "1"]}, "number"),
                     ({"scales": [1.0, 1.0, float("nan")]}, "number"),
                     ({"scales": [1.0, 1.0, float("inf")]}, "number"),
                     ({"scales": [1.0, 1.0, 0.0]}, "number"),
                     ({"scales": [1.0, 1.0, -1.0]}, "number"),
                     ({"scales": [1.0, 1.0, 1e6]}, "number")):
        with pytest.raises(KeyScalesError, match=why):
            parse_key_scales(raw, 3, "f")


@settings(max_examples=300, deadline=None)
@given(raw=json_values | st.fixed_dictionaries({"scales": st.lists(json_values, max_size=4)}))
def test_any_decoded_json_parses_or_raises_key_scales_error(raw):
    tried("key scales file")
    try:
        scales = parse_key_scales(raw, 3, "fuzz")
    except KeyScalesError:
        return
    assert len(scales.scales) == 3 and all(0.25 <= s <= 4 for s in scales.scales)


def test_unreadable_files_raise_key_scales_error(tmp_path):
    cases = {"missing.json": None, "not-json.json": b"{scales: [1]}",
             "binary.json": b"\xff\xfe\x00\x01", "deep.json": b"[" * 100_000 + b"]" * 100_000,
             "huge.json": b" " * (MAX_FILE_BYTES + 1)}
    for name, content in cases.items():
        path = tmp_path / name
        if content is not None:
            path.write_bytes(content)
        with pytest.raises(KeyScalesError):
            load_key_scales(path, 3)
    for special in (tmp_path, Path("/dev/zero")):  # a directory, an endless device
        with pytest.raises(KeyScalesError, match="not a regular file"):
            load_key_scales(special, 3)


def test_the_setting_selects_shipped_off_or_a_file(tmp_path, smollm2_dir):
    with pytest.raises(ValidationError):
        Settings(key_scales="")
    assert Settings().key_scales == "auto"
    shipped = resolve_key_scales("auto", smollm2_dir, 30)
    assert shipped is not None and len(shipped.scales) == 30
    assert shipped.source == str(SHIPPED_DIR / f"{smollm2_dir.name}.json")
    assert resolve_key_scales("off", smollm2_dir, 30) is None
    assert resolve_key_scales("auto", tmp_path / "another-model", 30) is None
    mine = tmp_path / "mine.json"
    mine.write_text(json.dumps({"scales": [0.9] * 30}))
    assert resolve_key_scales(str(mine), smollm2_dir, 30).scales == (0.9,) * 30
    # what a server process is given: the resolved file, or "off"
    assert resolve_for_server("auto", smollm2_dir) == shipped.source
    model = tmp_path / "another-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 2}))
    assert resolve_for_server("auto", model) == "off"
    with pytest.raises(KeyScalesError, match="30 scales for a model with 2 layers"):
        resolve_for_server(str(mine), model)
    (model / "config.json").write_text("[]")
    with pytest.raises(KeyScalesError, match="layer count"):
        resolve_for_server("off", model)


def test_the_shipped_file_records_how_it_was_fitted():
    for path in SHIPPED_DIR.glob("*.json"):
        raw = json.loads(path.read_text())
        fit = raw["fit"]
        assert raw["model"] == path.stem
        assert fit["held_out_kl"] <= fit["held_out_kl_unscaled"]
        assert 0 not in fit["conversations"]  # conversation 0 is what eval drift/fidelity use


def test_key_factor_scales_fact_tokens_only():
    scales = torch.tensor([0.5, 2.0])
    facts = torch.tensor([False, False, True, True, True])
    factor = key_factor(scales, facts)
    assert factor.shape == (2, 5, 1, 1)
    keys = torch.ones(2, 5, 3, 4)
    scaled = keys * factor
    assert torch.equal(scaled[:, :2], keys[:, :2])
    assert torch.equal(scaled[0, 2:], torch.full((3, 3, 4), 0.5))
    assert torch.equal(scaled[1, 2:], torch.full((3, 3, 4), 2.0))
