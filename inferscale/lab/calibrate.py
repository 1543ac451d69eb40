"""`inferscale calibrate`: fit the served model's key scales (``key_scales.py``), offline.

For questions of LoCoMo-format conversations (keep the ones you evaluate on out), at each k
(one fitted point of the scales file per k) the served prompt is composed as the front end
composes it, text prefill gives the first-token
distribution, and the facts' default encodings (after their w nearest earlier facts; the fact
served first after the preamble alone) are injected as the connector injects them, keys scaled
per layer. One log-scale per layer is fitted with Adam to the mean KL(text || inject) of the
first token. A fifth of the questions is held out: the scales of the epoch with the lowest
held-out KL are kept, starting from no scaling, so the file never does worse there than none.
One HF model in fp32 does everything (as ``eval drift``); K/V are kept in the model's dtype.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from inferscale.kv.key_scales import key_factor, load_key_scales, parse_key_scales
from inferscale.kv.rope import ChunkedRope
from inferscale.lab import drift


@dataclass
class Example:
    """One question's served prompt, text prefill's first-token log-probs and the memory's
    rotated, unscaled K/V [layers, tokens, heads, dim] as injection serves them."""

    prompt: drift.Prompt
    text_log: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor

    @property
    def runs(self) -> tuple[int, int]:
        """(preamble tokens, fact tokens) of the memory span."""
        start = self.prompt.spans[0][0] if self.prompt.spans else self.prompt.memory_end
        return start, self.prompt.memory_end - start


def first_token_log(encoder, example: Example, scales: torch.Tensor) -> torch.Tensor:
    """Inject ``example``'s memory with fact keys scaled by ``scales`` [layers], prefill the
    rest of the prompt: first-token log-probs (differentiable in ``scales``)."""
    prompt = example.prompt
    preamble, facts = example.runs
    k = example.k.float() * key_factor([(None, preamble), (scales, facts)],
                                       len(scales))[..., None, None]
    cache = drift.memory_cache(k, example.v.float())
    ids = torch.tensor(prompt.token_ids[prompt.memory_end:])
    out = encoder.model(input_ids=ids[None], past_key_values=cache,
                        position_ids=torch.arange(prompt.memory_end, len(prompt.token_ids))[None],
                        use_cache=True, logits_to_keep=1)
    return torch.log_softmax(out.logits[0, -1].float(), -1)


def kl_loss(encoder, example: Example, scales: torch.Tensor) -> torch.Tensor:
    """KL(text || inject) of the first token, in nats."""
    p_log = example.text_log
    return (p_log.exp() * (p_log - first_token_log(encoder, example, scales))).sum()


def kls(encoder, examples: Sequence[Example], scales: torch.Tensor) -> list[float]:
    """Per example, KL(text || inject) of the first token with ``scales`` (no gradients)."""
    with torch.no_grad():
        return [float(kl_loss(encoder, e, scales)) for e in examples]


def examples_for(encoder, embedder, facts: list[str], questions: list[str], ks: Sequence[int],
                 w: int, kv_dtype: torch.dtype) -> dict[int, list[Example]]:
    """Per k, the examples of one conversation's questions over its facts."""
    memory = drift.Memory(facts, embedder.encode(facts),
                          [encoder.layout.fact_segment(f) for f in facts])
    rope = ChunkedRope(encoder.config, torch.float32)
    preamble_span = encoder.encode_preamble()
    preamble = (preamble_span.k, preamble_span.v)
    encodings = drift.Encodings(encoder, memory)  # shared by every k
    return {k: [_example(encoder, embedder, memory, encodings, rope, preamble, question, k, w,
                         kv_dtype) for question in questions] for k in ks}


def _example(encoder, embedder, memory, encodings, rope, preamble, question: str, k: int, w: int,
             kv_dtype: torch.dtype) -> Example:
    strategy = drift.make_strategy(f"neighbours-pos0@{w}", memory, w, k)
    prompt = drift.compose(encoder, memory, question, embedder.encode([question])[0], k)
    text_log, _ = drift.text_reference(encoder, prompt, 1)
    plan = strategy.plan(prompt.order)
    encodings.ensure({(f, c) for f, cs in plan for c in cs})
    span = drift.memory_kv(preamble, [encodings.combined(f, cs) for f, cs in plan])
    keys = drift.served_keys(rope, span, prompt)
    return Example(prompt, text_log.float(), keys.to(kv_dtype), span[1].to(kv_dtype))


def fit(encoder, train: Sequence[Example], held_out: Sequence[Example], epochs: int,
        lr: float, seed: int = 0, log: Callable[[str], None] = print) -> dict:
    """Adam on per-layer log-scales. Kept: the scales of the epoch with the lowest held-out KL,
    if their paired held-out KL difference from no scaling has a 95% bootstrap interval below
    zero; else none (all 1): a gain within noise is not worth applying to every request."""
    from inferscale.lab.fidelity import bootstrap_mean_ci

    layers = encoder.config.num_hidden_layers
    log_scales = torch.zeros(layers, requires_grad=True)
    optimizer = torch.optim.Adam([log_scales], lr=lr)
    order = list(train)
    rng = random.Random(seed)
    ones = torch.ones(layers)
    none = kls(encoder, held_out, ones)
    best: dict[str, Any] = {"epoch": 0, "kls": none, "scales": [1.0] * layers}
    history = [{"epoch": 0, "train_kl": statistics.mean(kls(encoder, train, ones)),
                "held_out_kl": statistics.mean(none)}]
    log(f"epoch 0 (no scaling): train KL {history[0]['train_kl']:.4f}, held out "
        f"{history[0]['held_out_kl']:.4f}")
    for epoch in range(1, epochs + 1):
        rng.shuffle(order)
        for example in order:
            optimizer.zero_grad()
            kl_loss(encoder, example, log_scales.exp()).backward()
            optimizer.step()
        scales = log_scales.detach().exp()
        held = kls(encoder, held_out, scales)
        row = {"epoch": epoch, "train_kl": statistics.mean(kls(encoder, train, scales)),
               "held_out_kl": statistics.mean(held)}
        history.append(row)
        log(f"epoch {epoch}: train KL {row['train_kl']:.4f}, held out {row['held_out_kl']:.4f}")
        if row["held_out_kl"] < statistics.mean(best["kls"]):
            best = {"epoch": epoch, "kls": held, "scales": [round(float(s), 4) for s in scales]}
    ci = list(bootstrap_mean_ci([a - b for a, b in zip(best["kls"], none, strict=True)]))
    if not ci[1] < 0:
        log(f"epoch {best['epoch']}: held-out KL difference {ci} is not below 0: no scaling")
        best = {"epoch": 0, "kls": none, "scales": [1.0] * layers}
    return {"epoch": best["epoch"], "scales": best["scales"],
            "held_out_kl": statistics.mean(best["kls"]),
            "held_out_kl_unscaled": statistics.mean(none), "held_out_kl_diff_ci95": ci,
            "history": history}


def run(settings, data: Path, out: Path | None, conversations: Sequence[int] = (1, 2),
        questions: int = 40, ks: Sequence[int] = (20, 50), max_turns: int | None = 150,
        epochs: int = 4, lr: float = 0.02, seed: int = 1, threads: int = 2) -> Path:
    """Fit one point per k and write the scales file (default
    ``<data_dir>/key_scales/<model folder>.json``, ready for ``INFERSCALE_KEY_SCALES``); the
    points of other fact counts already in that file for this model are kept. Returns its path."""
    from inferscale.contracts.fingerprint import model_fingerprint
    from inferscale.core.model_prep import resolve_model_path
    from inferscale.kv.encoder import load_encoder
    from inferscale.pipeline.embedder import load_embedder

    if not ks or min(ks) < 1 or len(set(ks)) != len(ks):
        raise ValueError(f"fact counts (--k) must be distinct and >= 1, got {list(ks)}")
    if not conversations or questions < 1 or epochs < 0 or not lr > 0 or threads < 1:
        raise ValueError("calibrate needs conversations, questions >= 1, epochs >= 0, lr > 0 "
                         "and threads >= 1")
    torch.set_num_threads(threads)
    started = time.perf_counter()
    model_dir = resolve_model_path(settings)
    out = out or settings.data_dir / "key_scales" / f"{model_dir.name}.json"
    encoder = load_encoder(settings.model_copy(update={"device": "cpu",
                                                       "encode_dtype": "float32"}))
    layers = encoder.config.num_hidden_layers
    kept = _points_kept(out, model_dir.name, layers, ks)
    kv_dtype = encoder.kv_dtype
    encoder.kv_dtype = torch.float32
    for parameter in encoder.model.parameters():
        parameter.requires_grad_(False)
    embedder = load_embedder(settings)
    examples: dict[int, list[Example]] = {k: [] for k in ks}
    for conversation in conversations:
        facts, asked = drift.load_locomo(data, conversation, max_turns, questions, seed)
        for k, more in examples_for(encoder, embedder, facts, asked, ks, settings.window,
                                    kv_dtype).items():
            examples[k] += more
        print(f"conversation {conversation}: {len(asked)} questions over {len(facts)} facts "
              f"({time.perf_counter() - started:.0f} s)", flush=True)
    points = []
    for k, at_k in examples.items():
        if len(at_k) < 2:
            raise ValueError("calibration needs at least 2 questions (one is held out)")
        random.Random(seed).shuffle(at_k)
        held = max(1, len(at_k) // 5)
        fit_started = time.perf_counter()
        result = fit(encoder, at_k[held:], at_k[:held], epochs, lr, seed,
                     log=partial(print, f"k={k}", flush=True))
        points.append({"facts": k, "scales": result["scales"], "fit": {
            "data": str(data), "conversations": list(conversations), "questions": len(at_k),
            "held_out": held, "window": settings.window, "max_turns": max_turns,
            "epochs": epochs, "lr": lr, "seed": seed, "kept_epoch": result["epoch"],
            "held_out_kl_unscaled": result["held_out_kl_unscaled"],
            "held_out_kl": result["held_out_kl"],
            "held_out_kl_diff_ci95": result["held_out_kl_diff_ci95"],
            "history": result["history"],
            "fit_seconds": round(time.perf_counter() - fit_started, 1)}})
        print(f"k={k}: kept epoch {result['epoch']}, held-out KL "
              f"{result['held_out_kl_unscaled']:.4f} -> {result['held_out_kl']:.4f}")
    report = {"model": model_dir.name, "fingerprint": model_fingerprint(model_dir),
              "points": sorted(kept + points, key=lambda point: point["facts"])}
    parse_key_scales(report, layers, "the fitted scales")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out} ({time.perf_counter() - started:.0f} s)")
    return out


def _points_kept(out: Path, model: str, layers: int, ks: Sequence[int]) -> list[dict]:
    """The points of ``out`` (an existing scales file for ``model``) at fact counts not in ks."""
    if not out.exists():
        return []
    load_key_scales(out, layers)  # refuses a file that is not a valid scales file
    raw = json.loads(out.read_text())
    if raw.get("model") != model:
        raise ValueError(f"{out} holds key scales for {raw.get('model')!r}, not {model!r}")
    return [point for point in raw["points"] if point["facts"] not in ks]
