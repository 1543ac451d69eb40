"""The outbox of recorded turns (pure logic over a publish function): in order, each recording
retried until the broker takes it, bounded, and honest about what it drops or leaves behind."""

import asyncio
from datetime import UTC, datetime

import pytest
from aiokafka.errors import KafkaConnectionError, MessageSizeTooLargeError
from prometheus_client import REGISTRY

from inferscale.contracts.events import TurnEvent
from inferscale.serving.recording_outbox import RecordingOutbox


def _recording(owner: str, request: str, turns: int = 2) -> list[TurnEvent]:
    return [TurnEvent(user_id=owner, conversation_id="chat", turn_id=f"{request}.{i}",
                      speaker="user", text=f"turn {i}", timestamp=datetime.now(UTC))
            for i in range(turns)]


def _counted(outcome: str) -> float:
    return REGISTRY.get_sample_value("inferscale_recorded_turns_total",
                                     {"outcome": outcome}) or 0.0


class Broker:
    """A publish function whose broker is down for its first ``down`` calls, and refuses a
    named recording for good."""

    def __init__(self, down: int = 0, refuses: str | None = None):
        self.down, self.refuses = down, refuses
        self.calls: list[str] = []
        self.taken: list[str] = []

    async def __call__(self, turns: list[TurnEvent]) -> None:
        request = turns[0].turn_id.split(".")[0]
        self.calls.append(request)
        await asyncio.sleep(0)
        if request == self.refuses:
            raise MessageSizeTooLargeError("too large")
        if self.down > 0:
            self.down -= 1
            raise KafkaConnectionError("broker down")
        self.taken.append(request)


async def test_recordings_reach_the_broker_in_order_after_it_comes_back():
    broker = Broker(down=3)
    outbox = RecordingOutbox(broker, max_turns=100)
    retried, published = _counted("retried"), _counted("published")
    for request in ("a", "b", "c"):
        assert outbox.put(_recording("ann", request))
    assert outbox.held == 6
    assert await outbox.close(grace_s=30) == 0
    assert broker.taken == ["a", "b", "c"]  # the head is retried; the others wait behind it
    assert broker.calls == ["a"] * 4 + ["b", "c"]
    assert _counted("retried") - retried == 3 * 2 and _counted("published") - published == 6


async def test_a_recording_no_retry_mends_is_dropped_and_the_next_goes_on():
    broker = Broker(refuses="big")
    outbox = RecordingOutbox(broker, max_turns=100)
    failed = _counted("failed")
    for request in ("a", "big", "c"):
        outbox.put(_recording("ann", request))
    assert await outbox.close(grace_s=10) == 0
    assert broker.taken == ["a", "c"] and broker.calls.count("big") == 1
    assert _counted("failed") - failed == 2


async def test_a_full_outbox_refuses_new_recordings_and_keeps_the_old():
    broker = Broker(down=10**6)
    outbox = RecordingOutbox(broker, max_turns=5)
    dropped = _counted("dropped")
    assert outbox.put(_recording("ann", "a"))
    assert outbox.put(_recording("ann", "b"))
    assert not outbox.put(_recording("ann", "c"))  # 4 + 2 > 5
    assert outbox.put(_recording("ann", "d", turns=1))
    assert outbox.held == 5 and _counted("dropped") - dropped == 2
    await outbox.close(grace_s=0)


async def test_closing_waits_for_the_broker_then_says_what_is_lost():
    broker = Broker(down=10**6)
    outbox = RecordingOutbox(broker, max_turns=100)
    lost = _counted("lost")
    outbox.put(_recording("ann", "a"))
    outbox.put(_recording("bob", "b", turns=3))
    assert await outbox.close(grace_s=0.3) == 5
    assert _counted("lost") - lost == 5 and broker.taken == []
    assert not outbox.put(_recording("ann", "late"))  # closed: refused, counted
    assert broker.calls and set(broker.calls) == {"a"}


@pytest.mark.parametrize("grace", [0.0, 5.0])
async def test_closing_an_idle_outbox_loses_nothing(grace):
    assert await RecordingOutbox(Broker(), max_turns=1).close(grace) == 0
