"""`inferscale eval drift`: how far injected memory drifts from text prefill, offline.

No vLLM engine, no database: one HF model in fp32 does both sides. For each question the served
prompt is composed exactly as the front end does (top-k facts by embedding, best last, the
memory layout's token ids). ``text``: one forward of the whole prompt. ``inject``: the preamble's
and each fact's pre-RoPE K/V from the project's encoder, encoded after the context an encoding
*strategy* chooses, rotated to their serving positions with the project's Chunked RoPE, then a
forward of the tokens after the memory only. Per strategy: exact KL(text || inject) of the
first-token distribution (full vocabulary) and greedy agreement on the first token / first n.

A strategy maps (fact, its serving prefix) to the contexts the fact is encoded after (K/V are
averaged over several). Production strategies must ignore the serving prefix and use only the
user's earlier facts; ``oracle`` (the whole serving prefix) and ``oracle-local`` (its last w
facts) are diagnostics. Encodings are shared between strategies and questions: a fact encoded
after a context is computed once, and a fact whose context is a prefix of another encoded
sequence is sliced from that one pass (causal attention makes the two identical).

A ``/<selector>`` suffix adds selective recompute (what an engine hook inside the injected span
would buy): after injection, the selected memory positions are prefilled again, at their own
positions and attending to the injected K/V (whose own entries for them are masked out), together
with the question. Selectors: ``first<b>`` the first b tokens of every fact (EPIC's boundaries),
``blend<r>`` the fraction r of fact tokens whose layer-1 K/V deviate most from text prefill's
(CacheBlend's selection; costs one layer of full prefill), ``random<r>`` a seeded random
fraction r (the control), ``tail<m>`` every token of the last m facts (the server's tail
recompute, ``"recompute": m``, which vLLM's connector API does allow).
"""

from __future__ import annotations

import json
import math
import random
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from inferscale.contracts.kv_format import FORMATS, bits_of, quantize
from inferscale.kv.encoder import EncodeItem, FactEncoder
from inferscale.kv.key_scales import KeyScales, key_factor
from inferscale.kv.rope import ChunkedRope
from inferscale.lab.transform_coding import FixedRateCoder, TransformProfile, decode, encode

Context = tuple[int, ...]  # memory indices, in the order they precede the fact
Key = tuple[int, Context]  # (fact, context)
KV = tuple[torch.Tensor, torch.Tensor]  # pre-RoPE K and V, [layers, tokens, kv_heads, head_dim]


@dataclass
class Memory:
    """A user's facts in storage order (id order) with unit-norm embeddings."""

    texts: list[str]
    vectors: np.ndarray  # [facts, dim]
    segments: list[list[int]]  # each fact's token ids as the layout renders it

    def nearest(self, vector: np.ndarray, among: Sequence[int], n: int) -> list[int]:
        """Up to ``n`` of ``among`` nearest to ``vector`` by cosine distance, nearest first, ties
        by id (the order of the server's retrieval and of the worker's neighbour query)."""
        ids = np.asarray(among, dtype=np.int64)
        if n <= 0 or ids.size == 0:
            return []
        distance = 1.0 - self.vectors[ids].astype(np.float64) @ vector.astype(np.float64)
        return [int(ids[j]) for j in np.lexsort((ids, distance))[:n]]

    def served(self, query: np.ndarray, k: int, order: str = "relevance") -> list[int]:
        """The top-k facts in prompt order as ``frontend.compose`` lays them out: nearest first
        from retrieval, reversed (best last), or in stored order (``order="time"``)."""
        top = self.nearest(query, range(len(self.texts)), k)
        return sorted(top) if order == "time" else top[::-1]

    def neighbours(self, fact: int, w: int, skip: int = 0, among: Sequence[int] | None = None
                   ) -> Context:
        """The worker's neighbour context: the ``w`` earlier facts most similar to ``fact``
        (after the ``skip`` nearest), nearest last. ``among`` widens the candidates."""
        pool = range(fact) if among is None else [i for i in among if i != fact]
        return tuple(self.nearest(self.vectors[fact], pool, skip + w)[skip:][::-1])


SCALED = "+scales"  # strategy suffix: the facts' keys are scaled by the key scales
STORED = "%"  # strategy suffix: %<format>[:<lead format>], the facts' K/V stored so


def storage(kv_format: str, transform: TransformProfile | None = None
            ) -> Callable[[KV], tuple[KV, int]]:
    """K/V (fp32) as the server reads them back after storing them in ``kv_format`` (bf16 on
    the way), and the bytes stored: a format of ``kv_format.py``, or transform coded with the
    profile (``fr<mean bits>``, ``tc<quality>``: ``transform_coding.py``)."""
    if kv_format[:2] in ("fr", "tc") and kv_format not in FORMATS:
        if transform is None:
            raise ValueError(f"format {kv_format!r} needs a transform profile")
        try:
            amount = float(kv_format[2:])
        except ValueError:
            raise ValueError(f"format {kv_format!r}: expected fr<bits> or tc<quality>") from None
        if kv_format.startswith("fr"):
            coder = FixedRateCoder(transform, amount)

            def fixed_rate(kv: KV) -> tuple[KV, int]:
                coded = coder.encode(kv[0].to(torch.bfloat16), kv[1].to(torch.bfloat16))
                return coder.decode(coded, kv[0].shape[1], torch.float32), coder.nbytes(coded)

            return fixed_rate

        def uniform(kv: KV) -> tuple[KV, int]:
            blob = encode(kv[0].to(torch.bfloat16), kv[1].to(torch.bfloat16), transform, amount)
            return decode(blob, transform, torch.float32), len(blob)

        return uniform
    bits_of(kv_format)  # raises for an unknown format

    def stored(kv: KV) -> tuple[KV, int]:
        piece = quantize(kv[0].to(torch.bfloat16), kv[1].to(torch.bfloat16), kv_format)
        k, v = piece.dequantized()
        return (k.float(), v.float()), piece.nbytes

    return stored


class Strategy:
    """Contexts a fact is encoded after (averaged when several), given its serving prefix, the
    memory positions recomputed after injection (``recompute``, empty by default), whether
    the facts' keys are scaled by the key scales (``scaled``) and how they are stored
    (``formats``: body[:lead], ``storage``), with the bytes stored and their bf16 size."""

    def __init__(self, name: str, contexts: Callable[[int, Context], list[Context]],
                 recompute: str = "", scaled: bool = False, formats: str = "",
                 transform: TransformProfile | None = None):
        name += SCALED if scaled else ""
        name = f"{name}/{recompute}" if recompute else name
        self.name = f"{name}{STORED}{formats}" if formats else name
        self.contexts = contexts
        self.recompute = recompute
        self.scaled = scaled
        self.storage: tuple[Callable[[KV], tuple[KV, int]], ...] | None = None
        if formats:
            body, _, lead = formats.partition(":")
            self.storage = tuple(storage(f, transform) for f in (body, lead or body))
        self.stored_bytes = 0
        self.bf16_bytes = 0

    def stored(self, kv: KV, lead: bool) -> KV:
        """``kv`` as the server reads it back: in bf16, stored in the strategy's format (the
        lead format for a lead encoding); as computed where the strategy names none."""
        if self.storage is None:
            return kv
        back, stored_bytes = self.storage[int(lead)](kv)
        self.stored_bytes += stored_bytes
        self.bf16_bytes += 2 * kv[0].numel() * 2
        return back

    def plan(self, order: Sequence[int]) -> list[tuple[int, list[Context]]]:
        """(fact, the contexts it is encoded after) for facts served in ``order``."""
        return [(f, self.contexts(f, tuple(order[:pos]))) for pos, f in enumerate(order)]


def _coret(memory: Memory, fact: int, w: int, k: int) -> Context:
    """Co-retrieval context: each earlier fact's (and this fact's) embedding is a synthetic
    query over the facts that exist at encode time; where ``fact`` is in its top-k, the w facts
    ranked just below it are the ones served right before it. The w most frequent of those,
    the ones usually closest to the fact last."""
    pool = list(range(fact + 1))
    counts: Counter[int] = Counter()
    gaps: dict[int, list[int]] = defaultdict(list)
    for query in pool:
        top = memory.nearest(memory.vectors[query], pool, k)
        if fact in top:
            rank = top.index(fact)
            for gap, other in enumerate(top[rank + 1: rank + 1 + w], 1):
                counts[other] += 1
                gaps[other].append(gap)
    chosen = sorted(counts, key=lambda h: (-counts[h], statistics.mean(gaps[h]), h))[:w]
    return tuple(sorted(chosen, key=lambda h: (-statistics.mean(gaps[h]), h)))


def _select(memory: Memory, fact: int, prefix: Context, candidates: list[Context], w: int
            ) -> Context:
    """Of several stored encodings, the one whose context is closest (centroid cosine) to the
    ``w`` facts actually served before the fact; the context-free one when none is."""
    if not prefix:
        return ()
    served = memory.vectors[list(prefix[-w:])].mean(axis=0)
    served /= np.linalg.norm(served) or 1.0

    def score(context: Context) -> float:
        if not context:
            return -math.inf
        centroid = memory.vectors[list(context)].mean(axis=0)
        return float(centroid @ served / (np.linalg.norm(centroid) or 1.0))

    return max(candidates, key=score)


def make_strategy(spec: str, memory: Memory, default_w: int, k: int, seed: int = 0,
                  transform: TransformProfile | None = None) -> Strategy:
    """A strategy from ``name``, ``name@w``, either with ``+scales`` (key scales) and/or
    ``/<selector>``, then optionally ``%<format>[:<lead format>]`` (the K/V stored in that
    format, ``kv_format.py``); a ``-pos0`` suffix gives the fact served first (right after the
    preamble) its preamble-only encoding instead (its lead encoding)."""
    spec, _, formats = spec.partition(STORED)
    spec, _, recompute = spec.partition("/")
    if recompute:
        parse_selector(recompute)
    scaled = spec.endswith(SCALED)
    spec = spec.removesuffix(SCALED)
    name, _, window = spec.partition("@")
    w = int(window) if window else default_w
    label = name if name in ("oracle", "none") else f"{name}@{w}"
    m = memory

    def bands(fact: int) -> list[Context]:  # nearest ranks 1..w, w+1..2w, 2w+1..3w
        return [c for c in (m.neighbours(fact, w, skip) for skip in (0, w, 2 * w)) if c]

    def rand(fact: int) -> list[Context]:  # 3 random w-subsets of the 3w nearest, nearest last
        pool = m.neighbours(fact, 3 * w)
        rng = random.Random(seed * 1_000_003 + fact)
        picks = {tuple(sorted(rng.sample(range(len(pool)), min(w, len(pool)))))
                 for _ in range(3)}
        return [tuple(pool[j] for j in pick) for pick in sorted(picks)] or [()]

    coret_cache: dict[int, Context] = {}

    def coret(fact: int) -> Context:
        if fact not in coret_cache:
            coret_cache[fact] = _coret(m, fact, w, k)
        return coret_cache[fact]

    table: dict[str, Callable[[int, Context], list[Context]]] = {
        "oracle": lambda f, p: [p],
        "oracle-local": lambda f, p: [p[max(len(p) - w, 0):] if w else ()],
        "none": lambda f, p: [()],
        "turns": lambda f, p: [tuple(range(max(f - w, 0), f))],
        "neighbours": lambda f, p: [m.neighbours(f, w)],
        "neighbours-first": lambda f, p: [m.neighbours(f, w)[::-1]],
        # the same neighbours in stored order (as facts served in time order precede it)
        "neighbours-time": lambda f, p: [tuple(sorted(m.neighbours(f, w)))],
        # as many neighbours as facts precede it when served (none for the first fact)
        "neighbours-len": lambda f, p: [m.neighbours(f, min(len(p), w))],
        "neighbours-avg": lambda f, p: bands(f) or [()],
        "neighbours-rand": lambda f, p: rand(f),
        "neighbours-select": lambda f, p: [_select(m, f, p, [(), *bands(f)], w)],
        "neighbours-all": lambda f, p: [m.neighbours(f, w, among=range(len(m.texts)))],
        # a fact stored with fewer than w earlier facts is encoded again once its user has 3w
        # facts, after its w nearest among those (later facts too); the others as neighbours
        "neighbours-backfill": lambda f, p: [m.neighbours(
            f, w, among=range(min(len(m.texts), 3 * w)) if f < w else None)],
        # facts encoded in blocks of w, in storage order, each block after the one before it:
        # every fact sees the 0..w-1 earlier facts of its block and the w before (2x the tokens)
        "stream": lambda f, p: [tuple(range(max(0, f // w * w - w), f))],
        "coret": lambda f, p: [coret(f)],
    }
    base = name.removesuffix("-pos0")
    if base not in table:
        raise ValueError(f"unknown strategy {name!r}; known: {', '.join(table)} "
                         "(each also with -pos0)")
    contexts = table[base]
    if base != name:  # the first fact served gets its preamble-only encoding (exact there)
        return Strategy(label, lambda f, p: contexts(f, p) if p else [()], recompute, scaled,
                        formats, transform)
    return Strategy(label, contexts, recompute, scaled, formats, transform)


SELECTORS = ("first", "tail", "blend", "random")
COUNTED = ("first", "tail")  # selectors whose amount is a count, not a fraction


def parse_selector(spec: str) -> tuple[str, float]:
    """``first4`` -> ("first", 4.0); ``blend0.15`` -> ("blend", 0.15)."""
    for kind in SELECTORS:
        if spec.startswith(kind):
            try:
                amount = float(spec[len(kind):])
            except ValueError:
                break
            if amount < 0 or (kind not in COUNTED and amount > 1) or (
                    kind in COUNTED and amount != int(amount)):
                break
            return kind, amount
    raise ValueError(f"unknown recompute selector {spec!r}: first<tokens>, tail<facts>, "
                     "blend<fraction> or random<fraction>")


def select_positions(spec: str, spans: Sequence[tuple[int, int]], deviation: torch.Tensor | None,
                     seed: int) -> list[int]:
    """Memory positions to recompute: ``spans`` are the facts' [start, end); ``deviation`` is
    per memory position (``blend`` only)."""
    kind, amount = parse_selector(spec)
    if kind == "first":
        return [p for start, end in spans for p in range(start, min(start + int(amount), end))]
    if kind == "tail":
        return [p for start, end in spans[max(len(spans) - int(amount), 0):]
                for p in range(start, end)]
    facts = [p for start, end in spans for p in range(start, end)]
    n = round(amount * len(facts))
    if kind == "random":
        return sorted(random.Random(seed).sample(facts, n))
    if deviation is None:
        raise ValueError("blend needs the per-position deviation")
    scores = deviation[torch.tensor(facts, dtype=torch.long)]
    return sorted(facts[j] for j in scores.topk(n).indices.tolist())


def layer_deviation(injected_kv: KV, text_kv: KV, layer: int) -> torch.Tensor:
    """Per-token squared distance of pre-RoPE K and V at ``layer`` (each relative to the text
    tensor's mean square), injected vs text prefill: CacheBlend's selection signal."""
    scores = []
    for got, ref in zip(injected_kv, text_kv, strict=True):
        diff = (got[layer] - ref[layer]).float().pow(2).sum(dim=(-2, -1))
        scores.append(diff / ref[layer].float().pow(2).sum(dim=(-2, -1)).mean())
    return scores[0] + scores[1]


class Encodings:
    """Per-(fact, context) pre-RoPE K/V in fp32, computed in batched joint passes."""

    def __init__(self, encoder: FactEncoder, memory: Memory, max_batch_tokens: int = 4096):
        self.encoder = encoder
        self.memory = memory
        self.max_batch_tokens = max_batch_tokens
        self.kv: dict[Key, KV] = {}
        self.tokens = 0  # tokens run through the encoder (padding included)
        self.seconds = 0.0

    def ensure(self, keys: set[Key]) -> None:
        """Encode the missing keys: one sequence [preamble][context][fact] per maximal chain
        (a key whose context + fact is a prefix of another key's is sliced from it)."""
        missing = {key for key in keys if key not in self.kv}
        if not missing:
            return
        seqs = {key: (*key[1], key[0]) for key in missing}
        inner = {s[:j] for s in seqs.values() for j in range(1, len(s))}
        chains = sorted({s for s in seqs.values() if s not in inner},
                        key=lambda s: sum(len(self.memory.segments[i]) for i in s))
        wanted = set(seqs.values())
        batch: list[tuple[int, ...]] = []
        for chain in chains:
            width = len(self.encoder.layout.preamble_ids) + sum(
                len(self.memory.segments[i]) for i in chain)
            if batch and width * (len(batch) + 1) > self.max_batch_tokens:
                self._run(batch, wanted)
                batch = []
            batch.append(chain)
        if batch:
            self._run(batch, wanted)

    def _run(self, chains: list[tuple[int, ...]], wanted: set[tuple[int, ...]]) -> None:
        started = time.perf_counter()
        preamble = list(self.encoder.layout.preamble_ids)
        items = [EncodeItem(preamble, [t for i in chain for t in self.memory.segments[i]])
                 for chain in chains]
        spans = self.encoder.encode(items)
        width = max(len(preamble) + len(item.span_ids) for item in items)
        self.tokens += width * len(items)
        for chain, span in zip(chains, spans, strict=True):
            start = 0
            for j, fact in enumerate(chain):
                end = start + len(self.memory.segments[fact])
                if chain[: j + 1] in wanted:
                    self.kv[(fact, chain[:j])] = (span.k[:, start:end].clone(),
                                                  span.v[:, start:end].clone())
                start = end
        self.seconds += time.perf_counter() - started

    def combined(self, fact: int, contexts: list[Context]) -> KV:
        """The fact's K/V averaged over its contexts' encodings."""
        kvs = [self.kv[(fact, c)] for c in contexts]
        if len(kvs) == 1:
            return kvs[0]
        return (torch.stack([k for k, _ in kvs]).mean(0), torch.stack([v for _, v in kvs]).mean(0))

    def drop(self, keys: set[Key]) -> None:
        """Forget these encodings."""
        for key in keys:
            self.kv.pop(key, None)


@dataclass
class Prompt:
    """One question's served prompt."""

    question: str
    order: list[int]  # memory indices in prompt order
    token_ids: list[int]
    memory_end: int  # preamble + facts
    spans: list[tuple[int, int]]  # each fact's [start, end), in prompt order


def compose(encoder: FactEncoder, memory: Memory, question: str, query: np.ndarray, k: int,
            order: str = "relevance") -> Prompt:
    """The served prompt of ``question``: top-k facts in ``order`` and the chat, token ids as
    the front end composes them."""
    served = memory.served(query, k, order)
    plan = encoder.layout.compose([memory.segments[i] for i in served],
                                  [{"role": "user", "content": question}])
    end = plan.fact_spans[-1][1] if plan.fact_spans else plan.preamble_len
    return Prompt(question, served, plan.token_ids, end, plan.fact_spans)


def attention_masks(config, queries: torch.Tensor, entries: torch.Tensor, live: torch.Tensor
                    ) -> torch.Tensor | dict[str, torch.Tensor]:
    """Boolean ``[1, 1, queries, entries]`` mask (``queries`` and ``entries`` are positions):
    causal over the ``live`` entries, within the window on sliding-window layers. A model with
    both kinds of layer gets one mask per layer type, as its HF forward takes them."""
    causal = (entries[None, :] <= queries[:, None]) & live[None, :]
    window = getattr(config, "sliding_window", None)
    kinds = set(getattr(config, "layer_types", None)
                or ["sliding_attention" if window else "full_attention"])
    if not window or "sliding_attention" not in kinds:
        return causal[None, None]
    sliding = (causal & (queries[:, None] - entries[None, :] < window))[None, None]
    return sliding if kinds == {"sliding_attention"} else {
        "full_attention": causal[None, None], "sliding_attention": sliding}


def _greedy(model, logits: torch.Tensor, cache, position: int, n: int,
            entries: torch.Tensor | None = None, live: torch.Tensor | None = None) -> list[int]:
    """n greedy tokens from ``logits`` (the next-token logits at ``position``); where given,
    the cache's entries sit at positions ``entries`` and only the ``live`` ones are seen."""
    tokens = [int(logits.argmax())]
    while len(tokens) < n:
        mask = None
        if entries is not None and live is not None:
            entries = torch.cat([entries, torch.tensor([position])])
            live = torch.cat([live, torch.ones(1, dtype=torch.bool)])
            mask = attention_masks(model.config, torch.tensor([position]), entries, live)
        out = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=cache,
                    position_ids=torch.tensor([[position]]), attention_mask=mask,
                    use_cache=True, logits_to_keep=1)
        tokens.append(int(out.logits[0, -1].argmax()))
        position += 1
    return tokens


@torch.inference_mode()
def text_reference(encoder: FactEncoder, prompt: Prompt, n: int) -> tuple[torch.Tensor, list[int]]:
    """Text prefill: first-token log-probs (fp64, full vocabulary) and n greedy tokens."""
    model = encoder.model
    out = model(input_ids=torch.tensor([prompt.token_ids]), use_cache=True, logits_to_keep=1)
    logits = out.logits[0, -1]
    tokens = _greedy(model, logits, out.past_key_values, len(prompt.token_ids), n)
    return torch.log_softmax(logits.double(), -1), tokens


def memory_kv(preamble: KV, facts: list[KV]) -> KV:
    """The memory span's pre-RoPE K/V: the preamble's, then each fact's, in prompt order."""
    return (torch.cat([preamble[0], *(f[0] for f in facts)], dim=1),
            torch.cat([preamble[1], *(f[1] for f in facts)], dim=1))


def served_keys(rope: ChunkedRope, memory: KV, prompt: Prompt,
                key_scales: KeyScales | None = None) -> torch.Tensor:
    """The memory's keys as the connector writes them: rotated to their serving positions,
    the facts' (not the preamble's) scaled by ``key_scales`` for the prompt's fact count."""
    k = memory[0]
    if k.shape[1] != prompt.memory_end:
        raise ValueError("injected K/V do not cover the memory span")
    scales = None
    if key_scales is not None and prompt.spans:
        start = prompt.spans[0][0]
        scales = key_factor([(None, start), (key_scales.for_facts(len(prompt.spans)),
                                             prompt.memory_end - start)], k.shape[0])
    return rope.rotate(k, torch.arange(prompt.memory_end), scales)


def memory_cache(k: torch.Tensor, v: torch.Tensor):
    """An HF cache holding rotated keys ``k`` and values ``v`` [layers, tokens, heads, dim],
    every entry on every layer (sliding-window layers too: the masks apply their windows)."""
    from transformers import DynamicCache

    return DynamicCache(
        ddp_cache_data=[(k[layer].transpose(0, 1).unsqueeze(0).contiguous(),
                         v[layer].transpose(0, 1).unsqueeze(0).contiguous())
                        for layer in range(k.shape[0])])


@torch.inference_mode()
def injected(encoder: FactEncoder, rope: ChunkedRope, memory: KV, prompt: Prompt, n: int,
             recompute: Sequence[int] = (), key_scales: KeyScales | None = None
             ) -> tuple[torch.Tensor, list[int]]:
    """Inject the memory's K/V (``memory_kv``, keys as ``served_keys`` makes them), prefill
    the memory positions in ``recompute`` again (their injected entries masked out) and the
    tokens after the memory: first-token log-probs and n greedy tokens."""
    cache = memory_cache(served_keys(rope, memory, prompt, key_scales), memory[1])
    redo = torch.tensor(sorted(set(recompute)), dtype=torch.long)
    if redo.numel() and not (0 <= int(redo[0]) and int(redo[-1]) < prompt.memory_end):
        raise ValueError("recomputed positions must lie in the memory span")
    positions = torch.cat([redo, torch.arange(prompt.memory_end, len(prompt.token_ids))])
    mask = entries = live = None
    if redo.numel():  # query i sees live entries at positions <= its own
        live = torch.ones(prompt.memory_end + len(positions), dtype=torch.bool)
        live[redo] = False
        entries = torch.cat([torch.arange(prompt.memory_end), positions])
        mask = attention_masks(encoder.config, positions, entries, live)
    ids = torch.tensor(prompt.token_ids)[positions]
    out = encoder.model(input_ids=ids[None], past_key_values=cache,
                        position_ids=positions[None], attention_mask=mask, use_cache=True,
                        logits_to_keep=1)
    logits = out.logits[0, -1]
    tokens = _greedy(encoder.model, logits, out.past_key_values, len(prompt.token_ids), n,
                     entries, live)
    return torch.log_softmax(logits.double(), -1), tokens


def _recompute_positions(encoder: FactEncoder, job: Strategy, memory: KV, prompt: Prompt,
                         seed: int) -> list[int]:
    """The memory positions ``job`` recomputes for this prompt (``blend``: by the layer-1 K/V
    deviation from text prefill's, the fact tokens' K/V encoded after the true prefix)."""
    if not job.recompute:
        return []
    deviation = None
    if parse_selector(job.recompute)[0] == "blend":
        memory_ids = prompt.token_ids[: prompt.memory_end]
        text = encoder.encode([EncodeItem([], memory_ids)])[0]
        deviation = layer_deviation(memory, (text.k, text.v), layer=1)
    return select_positions(job.recompute, prompt.spans, deviation,
                            seed * 1_000_003 + sum(prompt.token_ids) % 1_000_003)


def kl(p_log: torch.Tensor, q_log: torch.Tensor) -> float:
    """Exact KL(P || Q) in nats from two full log-probability vectors."""
    return max(float((p_log.exp() * (p_log - q_log)).sum()), 0.0)


def top20_kl(p_log: torch.Tensor, q_log: torch.Tensor) -> float:
    """The KL estimate ``eval fidelity`` reports (``fidelity.top_kl`` on top-20 logprobs)."""
    from inferscale.lab.fidelity import top_kl

    def top(log: torch.Tensor) -> dict[int, float]:
        values, ids = log.topk(20)
        return dict(zip(ids.tolist(), values.tolist(), strict=True))

    return top_kl(top(p_log), top(q_log))


def measure(encoder: FactEncoder, memory: Memory, questions: list[tuple[str, np.ndarray]],
            ks: Sequence[int], strategies: Sequence[str], w: int = 5, first_n: int = 4,
            seed: int = 0, log: Callable[[str], None] = print,
            checkpoint: Callable[[dict], None] | None = None, order: str = "relevance",
            key_scales: KeyScales | None = None, transform: TransformProfile | None = None
            ) -> dict:
    """Every strategy at every k over the questions, facts served in ``order``; a summary and
    per-question records (``checkpoint`` gets the partial result after each strategy).
    ``key_scales``: what ``+scales`` strategies scale the facts' keys by; ``transform``: the
    profile of ``fr`` / ``tc`` formats."""
    from inferscale.lab.fidelity import bootstrap_mean_ci

    encoder.kv_dtype = torch.float32  # fp32 K/V: text and inject differ only by context
    rope = ChunkedRope(encoder.config, torch.float32)
    preamble_span = encoder.encode_preamble()
    preamble = (preamble_span.k, preamble_span.v)
    enc = Encodings(encoder, memory)
    records: list[dict] = []
    summary: dict[str, dict] = {}
    started = time.perf_counter()
    for k in ks:
        prompts = [compose(encoder, memory, q, vec, k, order) for q, vec in questions]
        t0 = time.perf_counter()
        refs = [text_reference(encoder, p, first_n) for p in prompts]
        log(f"k={k}: text prefill of {len(prompts)} prompts "
            f"({statistics.mean(len(p.token_ids) for p in prompts):.0f} tokens on average) "
            f"in {time.perf_counter() - t0:.1f} s")
        jobs = [make_strategy(s, memory, w, k, seed, transform) for s in strategies]
        if key_scales is None and any(job.scaled for job in jobs):
            raise ValueError(f"a {SCALED} strategy needs key scales")
        plans = [[job.plan(p.order) for p in prompts] for job in jobs]
        needs = [{(f, c) for plan in per_q for f, cs in plan for c in cs} for per_q in plans]
        for n, job in enumerate(jobs):
            t0, tokens0, enc_s0 = time.perf_counter(), enc.tokens, enc.seconds
            later = set().union(*needs[n + 1:])
            uses = Counter(key for plan in plans[n] for key in {(f, c) for f, cs in plan
                                                                  for c in cs})
            rows = []
            for prompt, plan, (ref_log, ref_tokens) in zip(prompts, plans[n], refs, strict=True):
                keys = {(f, c) for f, cs in plan for c in cs}
                enc.ensure(keys)  # question by question: per-question contexts stay bounded
                facts = [job.stored(enc.combined(f, cs), lead=pos == 0 and cs == [()])
                         for pos, (f, cs) in enumerate(plan)]
                uses.subtract(keys)
                enc.drop({key for key in keys if uses[key] == 0 and key not in later})
                memory_span = memory_kv(preamble, facts)
                redo = _recompute_positions(encoder, job, memory_span, prompt, seed)
                got_log, got_tokens = injected(encoder, rope, memory_span, prompt, first_n, redo,
                                               key_scales if job.scaled else None)
                fact_tokens = prompt.memory_end - len(preamble[0][0])
                rows.append({"k": k, "strategy": job.name, "question": prompt.question,
                             "recomputed": len(redo),
                             "recomputed_share": len(redo) / max(fact_tokens, 1),
                             "kl": kl(ref_log, got_log), "kl_top20": top20_kl(ref_log, got_log),
                             "first_token": got_tokens[0] == ref_tokens[0],
                             f"first_{first_n}": got_tokens == ref_tokens,
                             "text_tokens": ref_tokens, "inject_tokens": got_tokens})
            records += rows
            kls = [r["kl"] for r in rows]
            entry = {"k": k, "strategy": job.name, "questions": len(rows),
                     "kl_mean": statistics.mean(kls), "kl_median": statistics.median(kls),
                     "kl_ci95": list(bootstrap_mean_ci(kls)),
                     "kl_top20_mean": statistics.mean(r["kl_top20"] for r in rows),
                     "recomputed_share": statistics.mean(r["recomputed_share"] for r in rows),
                     "first_token": statistics.mean(r["first_token"] for r in rows),
                     f"first_{first_n}": statistics.mean(r[f"first_{first_n}"] for r in rows),
                     "encodings": len(needs[n]), "encode_tokens": enc.tokens - tokens0,
                     "encode_s": round(enc.seconds - enc_s0, 1),
                     "stored_share": (job.stored_bytes / job.bf16_bytes if job.bf16_bytes
                                      else None),
                     "seconds": round(time.perf_counter() - t0, 1)}
            summary[f"{job.name} k={k}"] = entry
            log(f"  {job.name:24s} k={k}: KL {entry['kl_mean']:.4f}  first token "
                f"{entry['first_token']:.0%}  first {first_n} {entry[f'first_{first_n}']:.0%}  "
                f"({entry['encode_tokens']} encode tokens, {entry['seconds']} s)")
            enc.drop(set(enc.kv) - later)
            if checkpoint is not None:
                checkpoint(_result(summary, records, started))
    return _result(summary, records, started)


def _result(summary: dict, records: list[dict], started: float) -> dict:
    from inferscale.lab.fidelity import bootstrap_mean_ci

    _paired(summary, records, bootstrap_mean_ci)
    return {"summary": summary, "records": records,
            "seconds": round(time.perf_counter() - started, 1)}


def _paired(summary: dict, records: list[dict], ci) -> None:
    """Per k, each strategy's KL minus the default's (neighbours@5) per question, with CI; a
    strategy with recompute or key scales also against the same encodings without either
    (``_base``)."""
    by: defaultdict[tuple[int, str], dict[str, float]] = defaultdict(dict)
    for r in records:
        by[(r["k"], r["strategy"])][r["question"]] = r["kl"]
    for entry in summary.values():
        mine = by[(entry["k"], entry["strategy"])]
        against = {"neighbours5": "neighbours@5",
                   "base": entry["strategy"].partition("/")[0].removesuffix(SCALED)}
        for label, other in against.items():
            base = by.get((entry["k"], other))
            if base and entry["strategy"] != other:
                diffs = [mine[q] - base[q] for q in mine]
                entry[f"kl_minus_{label}"] = statistics.mean(diffs)
                entry[f"kl_minus_{label}_ci95"] = list(ci(diffs))
                entry[f"closer_than_{label}"] = sum(d < 0 for d in diffs)


def load_locomo(data: Path, conversation: int, max_turns: int | None, questions: int, seed: int
                ) -> tuple[list[str], list[str]]:
    """Facts of one LoCoMo conversation's first ``max_turns`` turns (the ``turn`` extractor, in
    turn order) and the ``eval fidelity`` choice of questions (categories 1-4, seeded)."""
    from inferscale.lab.evaluate import pick_questions
    from inferscale.pipeline.extraction import TurnExtractor, TurnInContext
    from inferscale.pipeline.sources import locomo_turns

    sample = json.loads(data.read_text())[conversation]
    turns = list(locomo_turns([sample]))[:max_turns]
    drafts = TurnExtractor().extract([TurnInContext(t.speaker, t.text, t.timestamp)
                                      for t in turns])
    facts = [d.text for ds in drafts for d in ds]
    return facts, [q["question"] for q in pick_questions([sample], questions, seed)]


def run(settings, data: Path, out_dir: Path, conversation: int = 0, questions: int = 40,
        ks: Sequence[int] = (20,), strategies: Sequence[str] = ("oracle", "neighbours"),
        w: int = 5, max_turns: int | None = 150, seed: int = 1, first_n: int = 4,
        threads: int = 2, name: str = "drift", anchor: str | None = None,
        order: str = "relevance", transform: Path | None = None) -> dict:
    """Load the model, embedder and data; measure; print a table and write ``<name>.json``.

    ``anchor``: a layout variant where a fixed memory line follows the preamble (in text and
    inject alike, encoded once with it), so no retrieved fact sits right after the preamble.
    ``+scales`` strategies use the key scales ``settings.key_scales`` selects, at the server's
    ``key_scale_strength``. ``transform``: a profile (``calibrate transform``) for the ``fr`` /
    ``tc`` formats."""
    from inferscale.kv.encoder import load_encoder
    from inferscale.lab.bench.common import print_table, write_report
    from inferscale.pipeline.embedder import load_embedder

    torch.set_num_threads(threads)
    started = time.perf_counter()
    facts, asked = load_locomo(data, conversation, max_turns, questions, seed)
    embedder = load_embedder(settings)
    encoder = load_encoder(settings.model_copy(update={"device": "cpu",
                                                       "encode_dtype": "float32"}))
    if anchor:
        layout = encoder.layout
        layout.preamble_ids = layout.preamble_ids + layout.fact_segment(anchor)
    memory = Memory(facts, embedder.encode(facts),
                    [encoder.layout.fact_segment(f) for f in facts])
    query_vectors = [embedder.encode([q])[0] for q in asked]
    scales = None
    if any(spec.partition("/")[0].endswith(SCALED) for spec in strategies):
        from inferscale.core.model_prep import resolve_model_path
        from inferscale.kv.key_scales import resolve_key_scales

        scales = resolve_key_scales(settings.key_scales, resolve_model_path(settings),
                                    encoder.config.num_hidden_layers)
        if scales is None:
            raise ValueError(f"{SCALED} strategies need key scales (INFERSCALE_KEY_SCALES)")
        scales = scales.at_strength(settings.key_scale_strength)  # as the server applies them
    report = {"data": str(data), "conversation": conversation, "max_turns": max_turns,
              "facts": len(facts), "questions": len(asked), "seed": seed, "ks": list(ks),
              "w": w, "strategies": list(strategies), "first_n": first_n, "threads": threads,
              "dtype": "float32", "anchor": anchor, "order": order,
              "key_scales": scales.source if scales else None,
              "transform": str(transform) if transform else None}

    def save(partial: dict) -> None:
        write_report(out_dir, name, {**report, "complete": False, **partial})

    result = measure(encoder, memory, list(zip(asked, query_vectors, strict=True)), ks,
                     strategies, w, first_n, seed, checkpoint=save, order=order,
                     key_scales=scales,
                     transform=TransformProfile.load(transform) if transform else None)
    rows = [[name, s["kl_mean"], s["first_token"], s[f"first_{first_n}"],
             s.get("kl_minus_neighbours5", ""), s.get("kl_minus_base", ""),
             s["recomputed_share"], s["stored_share"] or "", s["encode_tokens"]]
            for name, s in result["summary"].items()]
    print_table(["strategy", "KL mean", "first token", f"first {first_n}",
                 "KL - neighbours@5", "KL - no recompute", "recomputed", "stored / bf16",
                 "encode tokens"], rows)
    path = write_report(out_dir, name, {**report, "complete": True, **result,
                                        "wall_s": round(time.perf_counter() - started, 1)})
    print(f"wrote {path}")
    return report
