"""A broker that dies mid-way loses no recorded turn: recordings stream into the server's outbox
while the real broker (tansu, topics kept in S3 so that they outlive it) is SIGKILLed and, a few
seconds later, started again on its port; every turn reaches the topic, in order per owner, and
the outbox says it retried."""

import asyncio
import os
import signal
import uuid
from datetime import UTC, datetime

import boto3
from prometheus_client import REGISTRY

from helpers import read_topic
from inferscale.contracts.events import TurnEvent
from inferscale.core.settings import Settings
from inferscale.devstack import infra
from inferscale.pipeline.kafka import ensure_topics, publish_turns
from inferscale.serving.recording_outbox import RecordingOutbox

RECORDINGS = 30
KILL_AT, RESTART_AT = 8, 18  # recordings put before the kill, and before the restart


def _recording(i: int) -> list[TurnEvent]:
    owner = f"owner-{i % 3}"
    return [TurnEvent(user_id=owner, conversation_id="chat", turn_id=f"r{i:03d}.{part}",
                      speaker=speaker, text=f"{speaker} {i}", timestamp=datetime.now(UTC))
            for part, speaker in (("u0", "user"), ("a", "assistant"))]


def _retried() -> float:
    return REGISTRY.get_sample_value("inferscale_recorded_turns_total",
                                     {"outcome": "retried"}) or 0.0


async def test_a_broker_killed_and_restarted_mid_way_loses_no_recorded_turn(
        s3_endpoint, tmp_path, monkeypatch):
    bucket = f"outbox-{uuid.uuid4().hex[:8]}"
    boto3.client("s3").create_bucket(Bucket=bucket)
    monkeypatch.setenv("AWS_ENDPOINT", s3_endpoint)  # tansu's names for the endpoint
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")
    broker = Settings(data_dir=tmp_path / "broker", kafka_storage=f"s3://{bucket}/")
    bootstrap = infra.start_kafka(broker)
    topic = f"recorded-{uuid.uuid4().hex[:6]}"

    async def publish(turns: list[TurnEvent]) -> None:
        await ensure_topics(bootstrap, [topic])
        await publish_turns(bootstrap, topic, turns, progress=False)

    outbox = RecordingOutbox(publish, max_turns=1_000)
    retried = _retried()
    try:
        for i in range(RECORDINGS):
            if i == KILL_AT:
                os.kill(infra.read_state(broker)["kafka"]["pid"], signal.SIGKILL)
            if i == RESTART_AT:
                held = outbox.held
                await asyncio.to_thread(infra.restart_kafka, broker)
                assert held > 0  # the broker was gone: recordings were waiting for it
            assert outbox.put(_recording(i))
            await asyncio.sleep(0.25)
        assert await outbox.close(grace_s=120) == 0
        records = await read_topic(bootstrap, topic, expected=2 * RECORDINGS, timeout_s=60)
    finally:
        infra.down(broker)
    events = [TurnEvent.model_validate_json(r.value) for r in records]
    turn_ids = [e.turn_id for e in events]
    assert set(turn_ids) == {t.turn_id for i in range(RECORDINGS) for t in _recording(i)}
    for owner in {e.user_id for e in events}:  # one partition per owner: in the order recorded
        theirs = [e.turn_id for e in events if e.user_id == owner]
        assert theirs == sorted(theirs, key=lambda t: (t.split(".")[0], t.endswith(".a")))
    assert _retried() > retried
