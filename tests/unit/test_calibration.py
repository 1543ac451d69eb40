"""A served model's calibration profile: the file, hostile files, which profile a server uses,
what it says at start, and that the operator's own settings win."""

import json

import pytest
from hypothesis import given, settings

from hostile import json_values
from inferscale.contracts.fingerprint import model_fingerprint
from inferscale.core.model_prep import resolve_model_path
from inferscale.core.settings import Settings, settings_env
from inferscale.serving import calibration
from inferscale.serving.calibration import (
    UNCALIBRATED,
    CalibrationError,
    calibrated,
    find_profile,
    profile_path,
    read_profile,
)

FINGERPRINT = "ab" * 32
OTHER = "cd" * 32


def _profile(fingerprint=FINGERPRINT, margin=1.0, text_margin=0.25, tail=4, **extra):
    return {"model": "m", "fingerprint": fingerprint,
            "recompute": {"margin": margin, "text_margin": text_margin, "tail": tail},
            "fit": {"reached": {"first_token": 0.96, "n": 200}, "frontier": []}, **extra}


def _write(path, content):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


def test_a_profile_reads_back(tmp_path):
    profile = read_profile(_write(tmp_path / "p.json", _profile()))
    assert (profile.recompute.margin, profile.recompute.text_margin, profile.recompute.tail) == (
        1.0, 0.25, 4)
    assert profile.fit.reached.first_token == 0.96


@pytest.mark.parametrize("content", [
    "not json", "[]", "{}", json.dumps(_profile(fingerprint="xyz")),
    json.dumps(_profile(margin=-1)), json.dumps(_profile(text_margin=float("nan"))),
    json.dumps(_profile(margin=1e9)), json.dumps(_profile(tail=10_000)),
    json.dumps(_profile(tail="2")), json.dumps(_profile(surprise=1)),
    json.dumps({**_profile(), "fit": {"reached": {"first_token": 2.0, "n": 3}}}),
    json.dumps({**_profile(), "fit": {"reached": {"first_token": 0.9, "n": 0}}}),
    json.dumps({**_profile(), "fit": []}),
    json.dumps({**_profile(), "fit": {"target": {"first_token": 0.95, "reached": "no"}}}),
])
def test_a_hostile_profile_is_refused_naming_the_file(tmp_path, content):
    path = _write(tmp_path / "p.json", content)
    with pytest.raises(CalibrationError, match="p.json"):
        read_profile(path)


def test_a_huge_profile_is_refused_unread(tmp_path):
    path = _write(tmp_path / "p.json", " " * (calibration.MAX_FILE_BYTES + 1))
    with pytest.raises(CalibrationError, match="larger"):
        read_profile(path)


@settings(max_examples=100, deadline=None)
@given(json_values)
def test_any_json_is_a_profile_or_a_clear_error(tmp_path_factory, value):
    path = _write(tmp_path_factory.mktemp("p") / "p.json", value)
    try:
        read_profile(path)
    except CalibrationError as exc:
        assert "p.json" in str(exc)


def test_which_profile_a_server_uses(tmp_path, monkeypatch):
    shipped = tmp_path / "shipped"
    monkeypatch.setattr(calibration, "SHIPPED_DIR", shipped)
    data_dir = tmp_path / "data"
    assert find_profile("auto", data_dir, FINGERPRINT) is None  # nothing anywhere
    _write(shipped / "other-model.json", _profile(OTHER, margin=3.0))
    assert find_profile("auto", data_dir, FINGERPRINT) is None  # never another model's
    _write(shipped / "m.json", _profile(margin=2.0))
    assert find_profile("auto", data_dir, FINGERPRINT).recompute.margin == 2.0
    _write(profile_path(data_dir, FINGERPRINT), _profile(margin=0.75))
    assert find_profile("auto", data_dir, FINGERPRINT).recompute.margin == 0.75  # own first
    assert find_profile("off", data_dir, FINGERPRINT) is None
    named = _write(tmp_path / "named.json", _profile(margin=1.5))
    assert find_profile(str(named), data_dir, FINGERPRINT).recompute.margin == 1.5
    with pytest.raises(CalibrationError, match="not the served model"):
        find_profile(str(named), data_dir, OTHER)
    with pytest.raises(CalibrationError, match="missing.json"):
        find_profile(str(tmp_path / "missing.json"), data_dir, FINGERPRINT)


def test_the_server_serves_the_profile_and_says_so(tmp_path):
    _write(profile_path(tmp_path, FINGERPRINT), _profile())
    chosen, line = calibrated(Settings(data_dir=tmp_path), FINGERPRINT)
    assert chosen == {"recompute_auto_margin": 1.0, "recompute_auto_text_margin": 0.25,
                      "recompute_auto_tail": 4, "recompute_auto_direct_margin": 0.0}
    assert "96.0%" in line and FINGERPRINT[:16] in line and "short" not in line
    _write(profile_path(tmp_path, FINGERPRINT), {**_profile(), "fit": {
        "reached": {"first_token": 0.91, "n": 200},
        "target": {"first_token": 0.95, "reached": False}}})
    _, short = calibrated(Settings(data_dir=tmp_path), FINGERPRINT)
    assert "91.0%" in short and "short of its 95% target" in short


def test_an_uncalibrated_model_gets_the_conservative_policy_and_is_told(tmp_path):
    chosen, line = calibrated(Settings(data_dir=tmp_path), OTHER)
    assert chosen == {"recompute_auto_margin": UNCALIBRATED.margin,
                      "recompute_auto_text_margin": UNCALIBRATED.text_margin,
                      "recompute_auto_tail": UNCALIBRATED.tail,
                      "recompute_auto_direct_margin": UNCALIBRATED.direct_margin}
    assert "no calibration" in line
    off, _ = calibrated(Settings(data_dir=tmp_path, calibration="off"), FINGERPRINT)
    assert off == chosen


def test_what_the_operator_set_wins_over_the_profile(tmp_path, monkeypatch):
    _write(profile_path(tmp_path, FINGERPRINT), _profile())
    monkeypatch.setenv("INFERSCALE_RECOMPUTE_AUTO_TEXT_MARGIN", "0.625")
    chosen, line = calibrated(Settings(data_dir=tmp_path), FINGERPRINT)
    assert chosen == {"recompute_auto_margin": 1.0, "recompute_auto_tail": 4,
                      "recompute_auto_direct_margin": 0.0}
    assert "recompute_auto_text_margin 0.625" in line and "set by you" in line


def test_a_profile_may_skip_the_tail_for_hopeless_answers(tmp_path):
    """``direct_margin`` (optional: profiles made before it still load) reaches its setting;
    a negative one is refused by name."""
    profile = _profile()
    profile["recompute"] = {**profile["recompute"], "direct_margin": 0.375}
    _write(profile_path(tmp_path, FINGERPRINT), profile)
    chosen, line = calibrated(Settings(data_dir=tmp_path), FINGERPRINT)
    assert chosen["recompute_auto_direct_margin"] == 0.375
    assert "recompute_auto_direct_margin 0.375" in line
    profile["recompute"]["direct_margin"] = -1.0
    _write(profile_path(tmp_path, FINGERPRINT), profile)
    with pytest.raises(CalibrationError, match="direct_margin|greater than"):
        calibrated(Settings(data_dir=tmp_path), FINGERPRINT)


def test_a_child_process_can_tell_what_was_set(tmp_path, monkeypatch):
    """settings_env passes on what was chosen, not the defaults, so the server a harness
    starts still calibrates."""
    monkeypatch.delenv("INFERSCALE_RECOMPUTE_AUTO_MARGIN", raising=False)
    env = settings_env(Settings(data_dir=tmp_path, top_k=7))
    assert env["INFERSCALE_TOP_K"] == "7" and "INFERSCALE_RECOMPUTE_AUTO_MARGIN" not in env
    monkeypatch.setattr("os.environ", env)
    child = Settings()
    assert child.top_k == 7 and child.data_dir == tmp_path
    assert "recompute_auto_margin" not in child.model_fields_set


def test_the_shipped_profiles_match_their_models():
    """Each shipped profile names a model this package can prepare, by its real fingerprint
    (SmolLM2 is installed with the package; others where prepared)."""
    models = resolve_model_path(Settings()).parent  # prepares SmolLM2 where it is not yet
    shipped = sorted(calibration.SHIPPED_DIR.glob("*.json"))
    assert shipped
    for path in shipped:
        profile = read_profile(path)
        assert path.stem == profile.model
        if (models / profile.model / "config.json").exists():
            assert model_fingerprint(models / profile.model) == profile.fingerprint, path.name


def test_the_server_process_gets_the_calibrated_settings(tmp_path, monkeypatch):
    """``inferscale serve`` hands its vLLM process the served model's profile (by the model's
    real fingerprint), or the conservative policy for a model without one."""
    from inferscale.serving.serve import server_command

    for name in calibration.SETTINGS.values():
        monkeypatch.delenv(f"INFERSCALE_{name.upper()}", raising=False)
    model = resolve_model_path(Settings())
    monkeypatch.setattr(calibration, "SHIPPED_DIR", tmp_path / "none shipped")
    base = Settings(data_dir=tmp_path, model_path=model, database_url="postgresql://db/x",
                    kafka_bootstrap="broker:9092")
    _, env = server_command(base)
    assert float(env["INFERSCALE_RECOMPUTE_AUTO_TEXT_MARGIN"]) == UNCALIBRATED.text_margin
    _write(profile_path(tmp_path, model_fingerprint(model)), _profile(model_fingerprint(model)))
    _, env = server_command(base)
    assert (float(env["INFERSCALE_RECOMPUTE_AUTO_MARGIN"]),
            float(env["INFERSCALE_RECOMPUTE_AUTO_TEXT_MARGIN"]),
            int(env["INFERSCALE_RECOMPUTE_AUTO_TAIL"])) == (1.0, 0.25, 4)
    _, env = server_command(base.model_copy(update={"recompute_auto_tail": 3}))
    assert int(env["INFERSCALE_RECOMPUTE_AUTO_TAIL"]) == 3
