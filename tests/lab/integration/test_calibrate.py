"""`inferscale calibrate` on a seeded tiny model and the shipped sample conversation."""

import dataclasses
import json

import pytest
import torch

from inferscale.core.settings import Settings
from inferscale.devstack.demo import SAMPLE
from inferscale.kv.encoder import FactEncoder
from inferscale.kv.key_scales import load_key_scales
from inferscale.lab import calibrate
from inferscale.lab.drift import load_locomo


def test_fit_recovers_known_scales(tiny_models, embedder):
    """Targets made by injecting with every fact key at 0.6 of its size: the fit moves the
    scales toward 0.6 and most of the KL goes."""
    encoder = FactEncoder(tiny_models["llama"], device="cpu", dtype=torch.float32)
    for parameter in encoder.model.parameters():
        parameter.requires_grad_(False)
    facts, questions = load_locomo(SAMPLE, 0, 12, 6, seed=1)
    examples = calibrate.examples_for(encoder, embedder, facts, questions, ks=[3], w=2,
                                      kv_dtype=torch.float32)[3]
    target = torch.full((3,), 0.6)
    with torch.no_grad():
        examples = [dataclasses.replace(e, text_log=calibrate.first_token_log(encoder, e, target))
                    for e in examples]
    result = calibrate.fit(encoder, examples[1:], examples[:1], epochs=8, lr=0.1,
                           log=lambda _: None)
    history = result["history"]
    assert history[-1]["train_kl"] < history[0]["train_kl"] / 4
    assert result["held_out_kl"] < result["held_out_kl_unscaled"]
    assert all(scale < 0.9 for scale in result["scales"])


def test_calibrate_writes_a_file_the_server_can_use(tiny_models, tmp_path):
    settings = Settings(data_dir=tmp_path, model_path=tiny_models["llama"], window=2)
    out = tmp_path / "scales.json"
    calibrate.run(settings, SAMPLE, out, conversations=(0,), questions=5, ks=(3,),
                  max_turns=12, epochs=1, threads=1)
    raw = json.loads(out.read_text())
    assert raw["model"] == "llama" and [p["facts"] for p in raw["points"]] == [3]
    fit = raw["points"][0]["fit"]
    assert len(fit["history"]) == 2
    # the kept scales never do worse on the held-out questions than no scaling
    assert fit["held_out_kl"] <= fit["held_out_kl_unscaled"]
    # a later run at another k adds its point and keeps this one
    calibrate.run(settings, SAMPLE, out, conversations=(0,), questions=3, ks=(2,),
                  max_turns=12, epochs=1, threads=1)
    scales = load_key_scales(out, 3)
    assert [n for n, _ in scales.points] == [2, 3]
    assert scales.points[1][1] == tuple(raw["points"][0]["scales"])
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**raw, "model": "another-model"}))
    with pytest.raises(ValueError, match="another-model"):
        calibrate.run(settings, SAMPLE, other, conversations=(0,), questions=3, ks=(2,),
                      max_turns=12, epochs=1, threads=1)


def test_calibrate_refuses_bad_arguments_before_any_work(tmp_path):
    settings = Settings(data_dir=tmp_path)
    for bad in ({"ks": ()}, {"ks": (0, 50)}, {"ks": (20, 20)}, {"questions": 0},
                {"conversations": ()}, {"epochs": -1}, {"lr": 0.0}, {"lr": float("nan")},
                {"threads": 0}):
        with pytest.raises(ValueError):
            calibrate.run(settings, SAMPLE, tmp_path / "s.json", **bad)
    assert not (tmp_path / "s.json").exists()
