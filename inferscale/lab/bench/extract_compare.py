"""Extraction: turn facts vs LLM facts on one conversation (throughput, facts per turn, tokens
and KV bytes per turn, fallbacks) and the update step's decisions on the LLM facts."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import numpy as np

from inferscale.kv.encoder import FactEncoder
from inferscale.kv.rope import model_head_dim
from inferscale.lab.bench.common import print_table, write_report
from inferscale.pipeline.embedder import load_embedder
from inferscale.pipeline.extraction import LLMExtractor, TurnExtractor, TurnInContext
from inferscale.pipeline.generators import LocalJsonGenerator
from inferscale.pipeline.sources import read_turns
from inferscale.pipeline.updates import LLMDecider, NewDraft, plan_updates


def run(model_path: Path, data: Path, out_dir: Path, turns: int = 40,
        batch_sizes: tuple[int, ...] = (1, 16), context: int = 3, candidates: int = 5) -> dict:
    """Extract ``turns`` turns of the first conversation with each extractor; print, save."""
    events = [t for t in read_turns(data) if t.user_id == next(read_turns(data)).user_id]
    items = [TurnInContext(t.speaker, t.text, t.timestamp,
                           [f"{p.speaker}: {p.text}" for p in events[max(0, i - context):i]])
             for i, t in enumerate(events[:turns])]
    encoder = FactEncoder(model_path)
    cfg = encoder.config
    bytes_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * model_head_dim(
        cfg) * encoder.kv_dtype.itemsize
    generator = LocalJsonGenerator.from_loaded(encoder.model, encoder.tokenizer, encoder.lock)
    extractors = [("turn", TurnExtractor(), 0)] + [
        (f"llm batch {b}", LLMExtractor(generator), b) for b in batch_sizes]
    LLMExtractor(generator).extract(items[:2])  # warm-up
    rows, results, llm_drafts = [], [], None
    for name, extractor, batch in extractors:
        began = time.perf_counter()
        drafts = [d for start in range(0, len(items), batch or len(items))
                  for d in extractor.extract(items[start:start + (batch or len(items))])]
        seconds = time.perf_counter() - began
        facts = [f for ds in drafts for f in ds]
        tokens = [len(encoder.layout.fact_segment(f.text)) for f in facts]
        result = {
            "extractor": name, "batch": batch, "turns": len(items), "seconds": seconds,
            "turns_per_s": len(items) / seconds, "facts": len(facts),
            "facts_per_turn": len(facts) / len(items),
            "tokens_per_fact": float(np.mean(tokens)) if tokens else 0.0,
            "kv_bytes_per_turn": sum(tokens) * bytes_per_token / len(items),
            "fallback_turns": getattr(extractor, "fallbacks", 0),
            "empty_turns": sum(not ds for ds in drafts),
            "examples": [{"turn": f"{i.speaker}: {i.text}", "facts": [d.text for d in ds]}
                         for i, ds in zip(items[:8], drafts[:8], strict=True)],
        }
        results.append(result)
        rows.append([name, f"{result['turns_per_s']:.2f}", f"{result['facts_per_turn']:.2f}",
                     f"{result['tokens_per_fact']:.1f}",
                     f"{result['kv_bytes_per_turn'] / 1e6:.3f}", result["fallback_turns"],
                     result["empty_turns"]])
        if batch:
            llm_drafts = [f for ds in drafts for f in ds]
    print_table(["extractor", "turns/s", "facts/turn", "tokens/fact", "KV MB/turn",
                 "fallbacks", "no facts"], rows)
    update = _updates(llm_drafts or [], generator, candidates)
    print(f"update step: {update['decisions']} decisions in {update['seconds']:.1f} s, "
          f"actions {update['actions']}, kept {update['kept']} of {update['drafts']} facts")
    report = {"model": str(model_path), "data": str(data), "results": results, "update": update}
    write_report(out_dir, "extract", report)
    return report


def _updates(facts: list, generator: LocalJsonGenerator, candidates: int) -> dict:
    """One user's LLM facts through the update step, in order (one decision per round)."""
    embedder = load_embedder()
    vectors: np.ndarray | list[np.ndarray] = (embedder.encode([f.text for f in facts])
                                              if facts else [])
    drafts = [NewDraft("u", f.text, np.asarray(v, dtype=np.float32))
              for f, v in zip(facts, vectors, strict=True)]
    decider = LLMDecider(generator)
    actions: Counter[str] = Counter()

    def decide(asked):
        decisions = decider(asked)
        actions.update(d.action for d in decisions)
        return decisions

    began = time.perf_counter()
    plan = plan_updates(drafts, [[] for _ in drafts], decide, candidates)
    return {"drafts": len(drafts), "decisions": sum(actions.values()),
            "seconds": time.perf_counter() - began, "actions": dict(actions),
            "kept": len(plan.keep)}
