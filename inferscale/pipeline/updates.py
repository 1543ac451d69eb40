"""The update step: each new fact against its user's nearest facts -> ADD, UPDATE, DELETE, NONE.

``plan_updates`` is pure: it walks a batch's new facts in turn order, in rounds (the r-th new
fact of every memory per round, so one batched decision call serves many users), and compares
each with the nearest of its memory's stored facts and of the new facts accepted earlier in the
batch. A memory is a user's facts of one exact scope (agent, run: ``contracts/scope.py``): a
fact never replaces another agent's or run's. UPDATE replaces the target with the new fact,
DELETE removes the target (the new fact is not kept), NONE drops the new fact. Any unusable
decision is an ADD: an update never loses a new fact.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from inferscale.contracts.scope import ANY, Scope
from inferscale.db.extract_queue import Retirement, StoredFact
from inferscale.pipeline.generators import JsonGenerator

Action = Literal["ADD", "UPDATE", "DELETE", "NONE"]
ACTIONS: tuple[Action, ...] = ("ADD", "UPDATE", "DELETE", "NONE")


@dataclass(frozen=True)
class Decision:
    """What to do with a new fact; ``target`` indexes the candidates it was shown."""

    action: Action
    target: int | None = None


ADD = Decision("ADD")
Decide = Callable[[Sequence[tuple[str, Sequence[str]]]], list[Decision]]


@dataclass(frozen=True)
class NewDraft:
    """A new fact of ``user_id`` (in ``scope``) with its (unit-norm) embedding."""

    user_id: str
    text: str
    embedding: np.ndarray
    scope: Scope = ANY

    @property
    def memory(self) -> Memory:
        return self.user_id, self.scope


Memory = tuple[str, Scope]  # a user's facts of one exact scope


@dataclass
class UpdatePlan:
    """Which new facts to store (indices into the batch) and which stored facts to retire
    (``Retirement.by`` is the index of the replacing new fact in the batch)."""

    keep: list[int] = field(default_factory=list)
    retire: list[Retirement] = field(default_factory=list)


def plan_updates(drafts: Sequence[NewDraft], stored: Sequence[Sequence[StoredFact]],
                 decide: Decide, candidates: int) -> UpdatePlan:
    """Decide every draft (``stored[i]``: its memory's stored facts nearest to draft i)."""
    order: dict[Memory, list[int]] = defaultdict(list)
    for i, d in enumerate(drafts):
        order[d.memory].append(i)
    retired: dict[int, Retirement] = {}  # by stored fact id
    kept: dict[Memory, list[int]] = defaultdict(list)  # accepted drafts per memory, in order
    for r in range(max((len(v) for v in order.values()), default=0)):
        round_ = [v[r] for v in order.values() if r < len(v)]
        shown = [_candidates(drafts, stored, i, retired, kept, candidates) for i in round_]
        asks = [(drafts[i].text, [text for _, text in c]) for i, c in zip(round_, shown,
                                                                          strict=True)]
        need = [j for j, c in enumerate(shown) if c]
        answers = dict(zip(need, decide([asks[j] for j in need]), strict=True)) if need else {}
        for j, i in enumerate(round_):
            _apply(i, answers.get(j, ADD), shown[j], drafts[i].memory, retired, kept)
    return UpdatePlan(keep=sorted(i for v in kept.values() for i in v),
                      retire=list(retired.values()))


Candidate = tuple[tuple[str, int], str]  # (("stored" | "draft", id or index), text)


def _candidates(drafts: Sequence[NewDraft], stored: Sequence[Sequence[StoredFact]], i: int,
                retired: dict[int, Retirement], kept: dict[Memory, list[int]], n: int
                ) -> list[Candidate]:
    """The n facts nearest to draft i: its stored neighbours still live and the drafts of its
    memory accepted so far, nearest first."""
    here = drafts[i]
    pool = [(("stored", f.id), f.text, np.asarray(f.embedding, dtype=np.float32))
            for f in stored[i] if f.id not in retired]
    pool += [(("draft", j), drafts[j].text, drafts[j].embedding) for j in kept[here.memory]]
    if not pool:
        return []
    vectors = np.stack([v for _, _, v in pool])
    sims = vectors @ here.embedding / np.maximum(np.linalg.norm(vectors, axis=1), 1e-12)
    best = np.argsort(-sims, kind="stable")[:n]
    return [(pool[b][0], pool[b][1]) for b in best]


def _apply(i: int, decision: Decision, shown: list[Candidate], memory: Memory,
           retired: dict[int, Retirement], kept: dict[Memory, list[int]]) -> None:
    user = memory[0]
    if decision.action in ("UPDATE", "DELETE"):
        if decision.target is None or not 0 <= decision.target < len(shown):
            decision = ADD
        else:
            (kind, ref), _ = shown[decision.target]
            by = i if decision.action == "UPDATE" else None
            if kind == "stored":
                retired[ref] = Retirement(user_id=user, fact_id=ref, by=by)
            else:  # a new fact of this batch: replaced before it was ever stored
                kept[memory].remove(ref)
                for fact_id, r in retired.items():  # what it replaced, this one replaces
                    if r.by == ref:
                        retired[fact_id] = Retirement(user_id=user, fact_id=fact_id, by=by)
            if by is not None:
                kept[memory].append(i)
            return
    if decision.action == "ADD":
        kept[memory].append(i)


DECISION_SCHEMA = {
    "type": "object",
    "properties": {"action": {"enum": list(ACTIONS)},
                   "target": {"type": ["integer", "null"]}},
    "required": ["action", "target"],
    "additionalProperties": False,
}
DECIDE_SYSTEM = (
    "You keep a personal assistant's memory up to date. Compare the new fact with the numbered "
    "memories. Answer ADD if it is new information; UPDATE with the number of the memory it "
    "replaces if it changes or refines that memory (e.g. a new home, job or plan); DELETE with "
    "the number of a memory it shows to be no longer true, when the new fact itself is not "
    "worth keeping; NONE if the memories already say it. "
    'Answer JSON: {"action": ..., "target": number or null}.'
)


def decide_prompt(new: str, memories: Sequence[str]) -> list[dict[str, str]]:
    listed = "\n".join(f"{n}. {m}" for n, m in enumerate(memories))
    return [{"role": "system", "content": DECIDE_SYSTEM},
            {"role": "user", "content": f"Memories:\n{listed}\n\nNew fact: {new}"}]


class LLMDecider:
    """ADD / UPDATE / DELETE / NONE from a language model, one batched generation per call."""

    def __init__(self, generator: JsonGenerator, max_tokens: int = 24):
        self.generator = generator
        self.max_tokens = max_tokens

    def __call__(self, items: Sequence[tuple[str, Sequence[str]]]) -> list[Decision]:
        answers = self.generator.generate([decide_prompt(new, mem) for new, mem in items],
                                          DECISION_SCHEMA, self.max_tokens)
        return [ADD if a is None else Decision(a["action"], a["target"]) for a in answers]
