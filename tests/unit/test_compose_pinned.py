"""Composing a memory prompt with pinned facts (pure logic: SmolLM2's real tokenizer, retrieval
answered by a stand-in): pinned facts lead every prompt in id order, in every mode; the plan
marks them exact where they are injected; one without KV sends every fact as text; text mode
injects nothing; a tail recompute prefills only retrieved facts."""

import asyncio

import numpy as np
import pytest
from transformers import AutoTokenizer

from inferscale.contracts.blob_name import fact_blob
from inferscale.contracts.layout import MemoryLayout
from inferscale.core.settings import Settings
from inferscale.db.reads import RetrievedFact
from inferscale.serving.compose import compose
from inferscale.serving.request_options import MemoryOptions

PINNED = {3: "Ines is vegetarian.", 8: "Ines prefers short answers."}
RANKED = {20: "Ines's horse is Biscuit.", 21: "Ines teaches chemistry.",
          22: "Clara lives in Montreal."}  # nearest first


class _Index:
    def __init__(self, facts: list[RetrievedFact]):
        self.facts = facts

    async def search(self, user_id, query, k, scope, where, pinned):
        first = [f for f in self.facts if f.pinned][:pinned]
        return first + [f for f in self.facts if not f.pinned][:k]


class _Embedder:
    def encode(self, texts):
        return np.zeros((len(texts), 384), np.float32)


class _Runtime:
    fingerprint = "f" * 64

    def __init__(self, layout: MemoryLayout, facts: list[RetrievedFact]):
        self.layout, self.index, self.embedder = layout, _Index(facts), _Embedder()
        self.settings = Settings()

    def note_served(self, owner, served, missed):
        pass


@pytest.fixture(scope="module")
def layout(smollm2_dir):
    return MemoryLayout(AutoTokenizer.from_pretrained(smollm2_dir))


def _facts(layout: MemoryLayout, without_kv: set[int] = frozenset()) -> list[RetrievedFact]:
    return [RetrievedFact(i, text, 0.1, layout.fact_segment(text),
                          None if i in without_kv else f"kv/{i}", f"c{i}", None, i in PINNED)
            for i, text in (*PINNED.items(), *RANKED.items())]


def _compose(layout, facts, **options):
    options = MemoryOptions(**{"mode": "inject", "k": 3, "recompute": 0, "lead": False,
                               **options})
    return asyncio.run(compose(_Runtime(layout, facts), "ines", options,
                               [{"role": "user", "content": "hi"}], "hi"))


def test_pinned_facts_lead_and_are_marked_exact(layout):
    prompt = _compose(layout, _facts(layout))
    assert prompt.pinned == [3, 8] and prompt.retrieved == 3
    assert prompt.fact_ids == [3, 8, 22, 21, 20]  # pinned in id order, then best last
    assert prompt.facts_injected == 5 and prompt.plan is not None
    pinned_end = len(layout.preamble_ids) + sum(len(layout.fact_segment(t))
                                                for t in PINNED.values())
    assert prompt.plan.exact == pinned_end == prompt.plan.segments[2].end
    assert [s.name for s in prompt.plan.segments[1:3]] == [fact_blob(3), fact_blob(8)]


def test_a_tail_recompute_prefills_retrieved_facts_only(layout):
    prompt = _compose(layout, _facts(layout), recompute=2)
    assert prompt.fact_ids == [3, 8, 22, 21, 20] and prompt.facts_injected == 3
    assert prompt.plan is not None and prompt.plan.exact > 0


def test_text_mode_keeps_the_order_and_injects_nothing(layout):
    prompt = _compose(layout, _facts(layout), mode="text")
    assert prompt.fact_ids == [3, 8, 22, 21, 20] and prompt.plan is None
    assert prompt.facts_injected == 0 and prompt.injected_tokens == 0


def test_a_pinned_fact_without_kv_sends_every_fact_as_text(layout):
    prompt = _compose(layout, _facts(layout, without_kv={8}))
    assert prompt.fact_ids == [3, 8, 22, 21, 20] and prompt.facts_injected == 0
    assert prompt.plan is not None and prompt.plan.exact == 0
    assert len(prompt.plan.segments) == 1  # the preamble only


def test_without_pinned_facts_nothing_is_marked_exact(layout):
    facts = [f for f in _facts(layout) if not f.pinned]
    prompt = _compose(layout, facts)
    assert prompt.pinned == [] and prompt.fact_ids == [22, 21, 20]
    assert prompt.plan is not None and prompt.plan.exact == 0
