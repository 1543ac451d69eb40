"""The soak's population: users with Zipf-distributed activity, each a LoCoMo conversation
replayed under their own id from an offset of their own (so no two users hold the same memory),
with their conversation's questions.

Invariants: a user's turn ids are unique and in order (``t0``, ``t1``, ...); turn ``i`` of user
``u`` is always the same text, so a run is reproducible from its seed; activity weights sum to 1.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from inferscale.contracts.events import TurnEvent
from inferscale.pipeline.sources import read_turns


@dataclass
class User:
    """One soak user: their conversation's turns from ``offset`` on, and its questions."""

    id: str
    source: list[TurnEvent]
    offset: int
    shift_days: int
    questions: list[str]
    next_turn: int = 0  # turns handed out so far

    def turn(self, i: int) -> TurnEvent:
        """The user's ``i``-th turn: the conversation's turn ``offset + i`` (wrapping round),
        owned by this user and shifted by ``shift_days``."""
        base = self.source[(self.offset + i) % len(self.source)]
        return base.model_copy(update={
            "user_id": self.id, "conversation_id": self.id, "turn_id": f"t{i}",
            "timestamp": base.timestamp + timedelta(days=self.shift_days)})

    def take(self, n: int) -> list[TurnEvent]:
        """The user's next ``n`` turns."""
        turns = [self.turn(i) for i in range(self.next_turn, self.next_turn + n)]
        self.next_turn += n
        return turns


@dataclass
class Population:
    """Users and their activity (the probability that a request or a turn is theirs)."""

    users: list[User]
    weights: list[float]
    rng: random.Random = field(default_factory=random.Random)

    def pick(self) -> User:
        """A user drawn by activity."""
        return self.rng.choices(self.users, self.weights)[0]


def zipf_weights(n: int, a: float, rng: random.Random) -> list[float]:
    """Zipf activity (rank r has weight r^-a), ranks shuffled over the users, normalised."""
    raw = [1.0 / (rank ** a) for rank in range(1, n + 1)]
    rng.shuffle(raw)
    total = sum(raw)
    return [w / total for w in raw]


def build(data: Path, prefix: str, users: int, zipf_a: float = 1.1, seed: int = 0
          ) -> Population:
    """``users`` users named ``<prefix>-<n>``: user n replays conversation n mod C of ``data``
    (a LoCoMo file) from an offset drawn per user, shifted n days."""
    rng = random.Random(seed)
    samples = json.loads(data.read_text())
    by_conversation: dict[str, list[TurnEvent]] = {}
    for event in read_turns(data):
        by_conversation.setdefault(event.user_id, []).append(event)
    questions = {s["sample_id"]: [q["question"] for q in s["qa"] if q.get("category") != 5]
                 for s in samples}
    ids = [s["sample_id"] for s in samples]
    population = []
    for n in range(users):
        source = by_conversation[ids[n % len(ids)]]
        population.append(User(f"{prefix}-{n}", source, rng.randrange(len(source)), n,
                               questions[ids[n % len(ids)]]))
    return Population(population, zipf_weights(users, zipf_a, rng), rng)
