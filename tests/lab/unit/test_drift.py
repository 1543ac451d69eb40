"""The offline drift harness on a seeded tiny model (no Kafka, Postgres or vLLM engine)."""

import numpy as np
import pytest
import torch

from inferscale.kv.encoder import FactEncoder
from inferscale.lab.drift import Encodings, Memory, make_strategy, measure, select_positions

SAID = ["Sam: I moved to Lisbon last month.", "Alex: Do you still work as a nurse?",
        "Sam: No, I am a marine biologist at the aquarium now.",
        "Alex: My octopus is called Pickles.", "Sam: I paint sunrises on weekends.",
        "Alex: We adopted a second cat in June.", "Sam: My sister runs a bakery in Porto."]


def _memory(encoder: FactEncoder, seed: int = 0) -> Memory:
    rng = np.random.default_rng(seed)
    vectors = rng.normal(size=(len(SAID), 16)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    return Memory(SAID, vectors, [encoder.layout.fact_segment(t) for t in SAID])


def _questions(n: int, seed: int = 1) -> list[tuple[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        v = rng.normal(size=16).astype(np.float32)
        out.append((f"What did Sam say about work ({i})?", v / np.linalg.norm(v)))
    return out


WINDOWED = ["llama", "mistral", "gemma3"]  # full attention, every layer slides, both kinds


@pytest.mark.parametrize("kind", WINDOWED)
def test_oracle_injection_equals_text_prefill(tiny_models, kind):
    """Prompts longer than the sliding windows (32 and 48 tokens): a window applied wrongly to
    the injected memory would show."""
    torch.manual_seed(0)
    encoder = FactEncoder(tiny_models[kind], device="cpu", dtype=torch.float32)
    memory = _memory(encoder)
    result = measure(encoder, memory, _questions(3), ks=[4], strategies=["oracle", "none"],
                     w=2, log=lambda _: None)
    oracle, none = result["summary"]["oracle k=4"], result["summary"]["none k=4"]
    assert oracle["kl_mean"] < 1e-6
    assert oracle["first_token"] == 1 and oracle["first_4"] == 1
    assert none["kl_mean"] > 100 * max(oracle["kl_mean"], 1e-9)  # context really matters here


def test_strategies_use_earlier_facts_only_and_share_encodings(tiny_models):
    encoder = FactEncoder(tiny_models["llama"], device="cpu", dtype=torch.float32)
    memory = _memory(encoder)
    prefix = (6, 1)
    for name in ("turns", "neighbours", "neighbours-first", "neighbours-time", "neighbours-len",
                 "neighbours-avg",
                 "neighbours-rand", "neighbours-select", "coret", "neighbours-pos0", "stream"):
        strategy = make_strategy(f"{name}@2", memory, 5, k=4)
        for fact in range(len(SAID)):
            for context in strategy.contexts(fact, prefix):
                assert all(i < fact for i in context), (name, fact, context)
    neighbours = make_strategy("neighbours@3", memory, 5, k=4).contexts(5, ())[0]
    assert len(neighbours) == 3
    # nearest last, as the worker orders its neighbour context
    sims = [float(memory.vectors[i] @ memory.vectors[5]) for i in neighbours]
    assert sims == sorted(sims)
    # -pos0: the fact served right after the preamble uses its preamble-only encoding
    pos0 = make_strategy("neighbours-pos0@3", memory, 5, k=4)
    assert pos0.contexts(5, ()) == [()] and pos0.contexts(5, (2,)) == [neighbours]
    # stream@3: blocks {0,1,2} {3,4,5} {6}; a fact sees its block's earlier facts and the block
    # before, so one pass per block encodes every fact of it
    stream = make_strategy("stream@3", memory, 5, k=4)
    assert [stream.contexts(f, prefix)[0] for f in range(len(SAID))] == [
        (), (0,), (0, 1), (0, 1, 2), (0, 1, 2, 3), (0, 1, 2, 3, 4), (3, 4, 5)]
    # A context that is a prefix of another encoded sequence is sliced from that one pass.
    enc = Encodings(encoder, memory)
    enc.ensure({(3, (0, 1, 2)), (2, (0, 1))})
    joint_k = enc.kv[(2, (0, 1))][0]
    alone = Encodings(encoder, memory)
    alone.ensure({(2, (0, 1))})
    torch.testing.assert_close(joint_k, alone.kv[(2, (0, 1))][0], rtol=1e-5, atol=1e-5)


def test_backfill_gives_a_users_first_facts_later_neighbours(tiny_models):
    """neighbours-backfill@w: facts stored before w earlier facts existed take their w nearest
    among the user's first 3w facts, later ones included; every other fact keeps neighbours@w."""
    encoder = FactEncoder(tiny_models["llama"], device="cpu", dtype=torch.float32)
    memory = _memory(encoder)
    backfill = make_strategy("neighbours-backfill@2", memory, 5, k=4)
    neighbours = make_strategy("neighbours@2", memory, 5, k=4)
    for fact in range(len(SAID)):
        [context] = backfill.contexts(fact, (6,))
        if fact < 2:
            assert len(context) == 2 and fact not in context and max(context) > fact
            assert context == memory.neighbours(fact, 2, among=range(6))
            assert all(i < 6 for i in context)
        else:
            assert [context] == neighbours.contexts(fact, (6,))


@pytest.mark.parametrize("kind", WINDOWED)
def test_recomputing_every_fact_token_equals_text_prefill(tiny_models, kind):
    """Selective recompute: prefilling memory positions again at their own positions, with
    their injected entries masked out, converges to text prefill when every fact token is
    recomputed; recomputing nothing is plain injection. Sliding-window layers see only their
    window of the injected and recomputed entries."""
    torch.manual_seed(0)
    encoder = FactEncoder(tiny_models[kind], device="cpu", dtype=torch.float32)
    memory = _memory(encoder)
    specs = ["none", "none/first0", "none/first1000", "none/random1", "none/blend1",
             "none/random0.5", "none/blend0.5"]
    summary = measure(encoder, memory, _questions(3), ks=[4], strategies=specs, w=2,
                      log=lambda _: None)["summary"]
    none = summary["none k=4"]
    assert summary["none/first0 k=4"]["kl_mean"] == pytest.approx(none["kl_mean"], rel=1e-6)
    assert summary["none/first0 k=4"]["recomputed_share"] == 0
    for full in ("none/first1000", "none/random1", "none/blend1"):
        assert summary[f"{full} k=4"]["recomputed_share"] == 1
        assert summary[f"{full} k=4"]["kl_mean"] < 1e-6, full
        assert summary[f"{full} k=4"]["first_4"] == 1, full
    for half in ("none/random0.5", "none/blend0.5"):
        assert 0.4 < summary[f"{half} k=4"]["recomputed_share"] < 0.6
        assert summary[f"{half} k=4"]["kl_mean"] < none["kl_mean"], half


def test_recompute_selectors():
    spans = [(3, 7), (7, 9), (9, 14)]
    assert select_positions("first2", spans, None, 0) == [3, 4, 7, 8, 9, 10]
    assert select_positions("first0", spans, None, 0) == []
    assert select_positions("tail1", spans, None, 0) == [9, 10, 11, 12, 13]
    assert select_positions("tail2", spans, None, 0) == [7, 8, 9, 10, 11, 12, 13]
    assert select_positions("tail0", spans, None, 0) == []
    assert select_positions("tail9", spans, None, 0) == list(range(3, 14))
    assert select_positions("tail4", spans, None, 0) == list(range(3, 14))  # more than there are
    deviation = torch.zeros(14)
    deviation[[5, 12, 1]] = torch.tensor([3.0, 2.0, 9.0])  # 1 is the preamble's: never chosen
    assert select_positions("blend0.2", spans, deviation, 0) == [5, 12]
    picked = select_positions("random0.5", spans, None, 7)
    assert len(picked) == 6 and set(picked) <= set(range(3, 14))
    assert picked == select_positions("random0.5", spans, None, 7)  # seeded
    for bad in ("first-1", "first1.5", "tail0.5", "blend2", "random", "middle3", "blendx"):
        with pytest.raises(ValueError):
            make_strategy(f"neighbours@2/{bad}", None, 5, k=4)


def test_time_order_serves_the_same_facts_in_stored_order(tiny_models):
    encoder = FactEncoder(tiny_models["llama"], device="cpu", dtype=torch.float32)
    memory = _memory(encoder)
    for _, query in _questions(4):
        relevance = memory.served(query, 4)
        assert memory.nearest(query, range(len(SAID)), 1) == relevance[-1:]  # best last
        assert memory.served(query, 4, "time") == sorted(relevance)


def test_scaled_strategies_scale_the_facts_keys_only(tiny_models):
    from inferscale.kv.key_scales import KeyScales
    from inferscale.kv.rope import ChunkedRope
    from inferscale.lab.drift import compose, served_keys

    encoder = FactEncoder(tiny_models["llama"], device="cpu", dtype=torch.float32)
    memory = _memory(encoder)
    questions = _questions(3)
    specs = ["neighbours@2", "neighbours@2+scales"]
    with pytest.raises(ValueError, match="key scales"):
        measure(encoder, memory, questions, ks=[4], strategies=specs, w=2, log=lambda _: None)

    def kls(scale: float) -> tuple[list[float], list[float]]:
        result = measure(encoder, memory, questions, ks=[4], strategies=specs, w=2,
                         log=lambda _: None, key_scales=KeyScales(((4, (scale,) * 3),), "t"))
        rows = result["records"]
        assert result["summary"]["neighbours@2+scales k=4"]["strategy"] == specs[1]
        return ([r["kl"] for r in rows if r["strategy"] == specs[0]],
                [r["kl"] for r in rows if r["strategy"] == specs[1]])

    plain, ones = kls(1.0)
    assert ones == plain
    plain_again, halved = kls(0.5)
    assert plain_again == plain
    assert all(abs(a - b) > 1e-6 for a, b in zip(halved, plain, strict=True))
    # the rule itself: fact rows scaled per layer, the preamble's untouched
    prompt = compose(encoder, memory, *questions[0], k=3)
    preamble = len(encoder.layout.preamble_ids)
    span = (torch.randn(3, prompt.memory_end, 2, 64), torch.randn(3, prompt.memory_end, 2, 64))
    rope = ChunkedRope(encoder.config, torch.float32)
    keys = served_keys(rope, span, prompt)
    scaled = served_keys(rope, span, prompt, KeyScales(((3, (0.5, 1.0, 2.0)),), "t"))
    assert prompt.spans[0][0] == preamble
    assert torch.equal(scaled[:, :preamble], keys[:, :preamble])
    for layer, scale in enumerate((0.5, 1.0, 2.0)):
        assert torch.allclose(scaled[layer, preamble:], keys[layer, preamble:] * scale)


def test_stored_formats_say_their_bytes_and_transform_ones_need_a_profile(tiny_models):
    """int4 and fixed-rate transform coding give back K/V close to what went in, with the
    bytes they stored against bf16's; an unknown format, or a transform one without a profile,
    is refused by name."""
    from inferscale.lab.drift import storage
    from inferscale.lab.transform_coding import ProfileFit

    encoder = FactEncoder(tiny_models["llama"], device="cpu", dtype=torch.float32)
    encoder.kv_dtype = torch.float32
    memory = _memory(encoder)
    encodings = Encodings(encoder, memory)
    keys = {(fact, ()) for fact in range(len(SAID))}
    encodings.ensure(keys)
    fit = ProfileFit()
    for key in sorted(keys):
        fit.add(*encodings.kv[key])
    profile = fit.profile("tiny")
    kv = encodings.kv[(3, ())]
    bf16 = 2 * kv[0].numel() * 2
    for kv_format, share in (("int4", 0.5), ("fr2", 0.25), ("fr8", 0.75)):
        (k, v), stored = storage(kv_format, profile)(kv)
        assert k.shape == kv[0].shape and stored < share * bf16
        assert (k - kv[0]).abs().mean() < 0.25 * kv[0].abs().mean()
    job = make_strategy("none%fr1:int8", memory, 2, 3, transform=profile)
    job.stored(kv, lead=False)
    job.stored(kv, lead=True)
    assert job.stored_bytes < job.bf16_bytes == 2 * bf16
    for bad in ("int3", "fr", "frx", "tc"):
        with pytest.raises(ValueError):
            storage(bad, profile)
    with pytest.raises(ValueError, match="transform profile"):
        make_strategy("none%fr1", memory, 2, 3)
