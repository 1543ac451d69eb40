"""Two vLLM replicas, one durable tier on an S3 bucket (moto_server): KV a separate encoder wrote
to the bucket is injected by either replica, exactly as text prefill answers (tiny fp32 Llama,
one fact encoded after exactly its serving prefix), and no blob touches a local disk."""

import uuid

import pytest
import torch

from conftest import BUCKET, running_server
from helpers import ingest_and_encode, metric, turn
from inferscale.contracts.blob_name import fact_blob
from inferscale.contracts.fingerprint import model_fingerprint
from inferscale.kv.durable import S3Objects
from inferscale.kv.encoder import FactEncoder
from inferscale.kv.store import KVStore

pytestmark = pytest.mark.slow

SERVER_ARGS = ["--enforce-eager", "--dtype", "float32", "--max-model-len", "2048"]


@pytest.fixture(scope="module")
def replicas(base_settings, tiny_models, tmp_path_factory, s3_endpoint):
    root = tmp_path_factory.mktemp("replicas")
    shared = base_settings.model_copy(update={
        "model_path": tiny_models["llama"], "window": 0, "top_k": 1,
        "kv_url": f"s3://{BUCKET}/replicas-{uuid.uuid4().hex[:6]}/kv"})
    a, b = (shared.model_copy(update={"data_dir": root / name}) for name in "ab")
    with running_server(a, root / "a.log", SERVER_ARGS) as one, \
            running_server(b, root / "b.log", SERVER_ARGS) as two:
        yield one, two


async def test_either_replica_injects_what_a_worker_wrote_to_the_bucket(
        replicas, tiny_models, engine, embedder, tmp_path):
    one, two = replicas
    worker = one.settings.model_copy(update={"data_dir": tmp_path})  # the worker's own disk
    encoder = FactEncoder(tiny_models["llama"], device="cpu", dtype=torch.float32)
    store = KVStore.from_settings(worker, model_fingerprint(tiny_models["llama"]),
                                  host_bytes=0)
    assert isinstance(store.durable, S3Objects)
    user = f"replica-{uuid.uuid4().hex[:6]}"
    fact = turn(user, "t1", "Sam", "I repair violins in a small shop in Cremona.")
    await ingest_and_encode(worker, engine, embedder, [fact], encoder, store)
    question = "What does Sam do for a living?"
    kwargs = {"logprobs": True, "top_logprobs": 5, "max_tokens": 8}
    text = one.chat(user, question, k=1, mode="text", **kwargs)
    assert text.status_code == 200, text.text
    expected = [c["token"] for c in text.json()["choices"][0]["logprobs"]["content"]]
    for replica in (one, two):
        injected = replica.chat(user, question, k=1, **kwargs)
        assert injected.status_code == 200, injected.text
        assert injected.headers["x-inferscale-facts-injected"] == "1"
        assert injected.json()["kv_transfer_params"]["injected_tokens"] > len(
            encoder.layout.preamble_ids)
        content = injected.json()["choices"][0]["logprobs"]["content"]
        assert [c["token"] for c in content] == expected
    blobs = list(store.durable.list())
    assert any(location.endswith(".safetensors") for location in blobs)
    for root in (one.settings.data_dir, two.settings.data_dir, tmp_path):
        assert not list(root.rglob("*.safetensors"))


async def test_an_edit_on_one_replica_is_what_the_other_serves(replicas, tiny_models, engine,
                                                                embedder, tmp_path):
    """Both replicas hold the fact's KV in memory; the fact is edited through one replica's
    memory API: at once the other serves the new version (as text) and never the old one,
    whose blob leaves the bucket and, through the invalidation topic, the other's memory."""
    import asyncio

    from inferscale.client import MemoryClient

    one, two = replicas
    worker = one.settings.model_copy(update={"data_dir": tmp_path})
    encoder = FactEncoder(tiny_models["llama"], device="cpu", dtype=torch.float32)
    store = KVStore.from_settings(worker, model_fingerprint(tiny_models["llama"]),
                                  host_bytes=0)
    user = f"replica-edit-{uuid.uuid4().hex[:6]}"
    await ingest_and_encode(worker, engine, embedder, [
        turn(user, "t1", "Sam", "I repair violins in a small shop in Cremona.")],
        encoder, store)
    question = "What does Sam do for a living?"
    for replica in (one, two):  # each now holds the blob in its host tier
        assert replica.chat(user, question, k=1).headers["x-inferscale-facts-injected"] == "1"
    old = MemoryClient(one.url).list_facts(user)["facts"][0]

    purged_before = metric(two, "inferscale_purged_blobs_total")
    new = MemoryClient(one.url).edit_fact(user, old["id"], "I build cellos in Cremona now.")
    answer = two.chat(user, question, k=1)
    assert answer.headers["x-inferscale-fact-ids"] == str(new["id"])
    assert answer.headers["x-inferscale-facts-injected"] == "0"  # new: text until encoded
    assert not store.durable.exists(store.location_for(fact_blob(old["id"])))
    for _ in range(120):  # the invalidation reaches the other replica's workers
        if metric(two, "inferscale_purged_blobs_total") > purged_before:
            break
        await asyncio.sleep(0.5)
    assert metric(two, "inferscale_purged_blobs_total") > purged_before
