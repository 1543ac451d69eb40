"""Key scales: the file format, the setting, hostile files, and the scaling rule."""

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from hostile import json_values, tried
from inferscale.core.settings import Settings
from inferscale.kv.key_scales import (
    MAX_FILE_BYTES,
    SHIPPED_DIR,
    KeyScalesError,
    key_factor,
    load_key_scales,
    parse_key_scales,
    resolve_for_server,
    resolve_key_scales,
)


def _file(*points: tuple[int, list]) -> dict:
    return {"model": "m", "points": [{"facts": n, "scales": scales} for n, scales in points]}


def test_a_valid_file_parses_and_bad_ones_say_why():
    good = parse_key_scales(_file((50, [0.5, 1, 2.0]), (20, [1.0, 1.0, 1.0])), 3, "f")
    assert good.points == ((20, (1.0, 1.0, 1.0)), (50, (0.5, 1.0, 2.0))) and good.source == "f"
    for raw, why in (([1.0], "object"), ({"scales": [1.0] * 3}, "object"),
                     ({"points": []}, "non-empty"), ({"points": [[50, [1.0] * 3]]}, "object"),
                     (_file((50, [1.0, 1.0])), "expected 3 scales"),
                     (_file((50, "1,1,1")), "expected 3 scales"),
                     (_file((0, [1.0] * 3)), "facts"), (_file((True, [1.0] * 3)), "facts"),
                     (_file((2.5, [1.0] * 3)), "facts"), (_file((10**6, [1.0] * 3)), "facts"),
                     (_file((5, [1.0] * 3), (5, [1.0] * 3)), "distinct"),
                     (_file((5, [1.0, 1.0, True])), "number"),
                     (_file((5, [1.0, 1.0, None])), "number"),
                     (_file((5, [1.0, 1.0, "1"])), "number"),
                     (_file((5, [1.0, 1.0, float("nan")])), "number"),
                     (_file((5, [1.0, 1.0, float("inf")])), "number"),
                     (_file((5, [1.0, 1.0, 0.0])), "number"),
                     (_file((5, [1.0, 1.0, -1.0])), "number"),
                     (_file((5, [1.0, 1.0, 1e6])), "number")):
        with pytest.raises(KeyScalesError, match=why):
            parse_key_scales(raw, 3, "f")


def test_scales_follow_the_number_of_injected_facts_log_linearly():
    scales = parse_key_scales(_file((20, [0.5, 2.0]), (50, [0.25, 1.0])), 2, "f")
    at = {n: scales.for_facts(n).tolist() for n in (0, 10, 20, 35, 50, 80)}
    assert at[0] == [1.0, 1.0]  # nothing injected: nothing to scale
    assert at[10] == pytest.approx([0.5 ** 0.5, 2.0 ** 0.5])  # toward 1 below the first point
    assert at[20] == pytest.approx([0.5, 2.0]) and at[50] == pytest.approx([0.25, 1.0])
    assert at[35] == pytest.approx([0.5 ** 0.5 * 0.25 ** 0.5, 2.0 ** 0.5])  # halfway in log
    assert at[80] == at[50]  # the last point beyond it
    weaker = scales.at_strength(0.75)  # what the harness uses: the server's per-request power
    for n in (0, 10, 20, 35, 50, 80):
        assert weaker.for_facts(n).tolist() == pytest.approx(
            (scales.for_facts(n) ** 0.75).tolist(), rel=1e-6)


@settings(max_examples=300, deadline=None)
@given(raw=json_values | st.fixed_dictionaries({"points": st.lists(
    json_values | st.fixed_dictionaries({"facts": json_values | st.integers(-2, 20_000),
                                         "scales": st.lists(json_values, max_size=4)}),
    max_size=3)}), facts=st.integers(-5, 20_000))
def test_any_decoded_json_parses_or_raises_key_scales_error(raw, facts):
    tried("key scales file")
    try:
        scales = parse_key_scales(raw, 3, "fuzz")
    except KeyScalesError:
        return
    got = scales.for_facts(facts)
    assert got.shape == (3,) and bool(((got >= 0.25 - 1e-6) & (got <= 4 + 1e-6)).all())


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
    assert shipped is not None and {n for n, _ in shipped.points} >= {20, 50}
    assert shipped.source == str(SHIPPED_DIR / f"{smollm2_dir.name}.json")
    assert resolve_key_scales("off", smollm2_dir, 30) is None
    assert resolve_key_scales("auto", tmp_path / "another-model", 30) is None
    mine = tmp_path / "mine.json"
    mine.write_text(json.dumps(_file((50, [0.9] * 30))))
    assert resolve_key_scales(str(mine), smollm2_dir, 30).points == ((50, (0.9,) * 30),)
    # what a server process is given: the resolved file, or "off"
    assert resolve_for_server("auto", smollm2_dir) == shipped.source
    model = tmp_path / "another-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 2}))
    assert resolve_for_server("auto", model) == "off"
    with pytest.raises(KeyScalesError, match="expected 2 scales"):
        resolve_for_server(str(mine), model)
    (model / "config.json").write_text("[]")
    with pytest.raises(KeyScalesError, match="layer count"):
        resolve_for_server("off", model)


def test_the_shipped_file_records_how_it_was_fitted():
    for path in SHIPPED_DIR.glob("*.json"):
        raw = json.loads(path.read_text())
        assert raw["model"] == path.stem
        for point in raw["points"]:
            fit = point["fit"]
            assert fit["held_out_kl"] <= fit["held_out_kl_unscaled"]
            assert 0 not in fit["conversations"]  # conversation 0: eval drift / fidelity's


def test_key_factor_scales_runs_of_fact_tokens_only():
    factor = key_factor([(None, 2), (torch.tensor([0.5, 2.0]), 3), (None, 1)], 2)
    assert factor.shape == (2, 6)
    keys = torch.ones(2, 6, 3, 4)
    scaled = keys * factor[..., None, None]
    assert torch.equal(scaled[:, :2], keys[:, :2]) and torch.equal(scaled[:, 5:], keys[:, 5:])
    assert torch.equal(scaled[0, 2:5], torch.full((3, 3, 4), 0.5))
    assert torch.equal(scaled[1, 2:5], torch.full((3, 3, 4), 2.0))


@pytest.mark.parametrize("raw", ["-0.5", "1.5", "nan", "strong"])
def test_default_strength_setting_refuses_values_outside_0_1(monkeypatch, raw):
    monkeypatch.setenv("INFERSCALE_KEY_SCALE_STRENGTH", raw)
    with pytest.raises(ValidationError, match="key_scale_strength"):
        Settings()
