"""`inferscale eval fidelity`: does injected memory answer like the same memory prefilled?

Each conversation is ingested through the real pipeline (Kafka -> worker process -> Postgres and
KV store) once per encoding. Then QA items of categories 1-4 are answered through the
server, streamed, greedy, with logprobs: ``none``; ``text`` (top-k facts prefilled); with
``--prefix-hit``, ``prefix hit`` (the same text prompt answered again from vLLM's prefix cache:
the physical best, and a second numeric path of exact text); ``inject``
(the same facts, same order, as KV) per encoding (context ``turns``: the w preceding turns, or
``neighbours``: the w most similar earlier facts), per tail-recompute m and with or without the
lead encoding for the first fact served (``--lead on off``), with or without the key scales
(``--key-scales on off``), and with ``--oracle``
KV encoded with exactly its serving prefix (what is left is numerics). Per configuration: LoCoMo
F1, agreement with text on generated token ids (first token, first 4, whole answer), mean KL of
the first-token distributions, the F1 gap with a paired bootstrap interval, and TTFT (each
question's facts are paged into the host tier before its timed answers) with paired bootstrap
intervals of the median ratios to text prefill and to the prefix hit.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx

from inferscale.core.endpoints import resolve_kafka_bootstrap
from inferscale.core.settings import Settings
from inferscale.db.engine import create_engine
from inferscale.devstack.chat_client import stream_chat
from inferscale.devstack.stack import prepare, server_process, wait_encoded, worker_process
from inferscale.lab.bench.common import (
    auto_costs,
    print_table,
    settings_differing,
    write_report,
)
from inferscale.lab.fidelity import (
    bootstrap_median_ratio_ci,
    compare,
    exact_path_agreement,
    served_as_kv,
)
from inferscale.lab.scoring import exact_match, locomo_f1
from inferscale.pipeline.kafka import ensure_topics, kafka_security, publish_turns
from inferscale.pipeline.sources import locomo_turns

TOP_LOGPROBS = 20


@dataclass(frozen=True)
class Config:
    """One way of answering: a memory mode, k, the encoding (context, window) of the user's KV,
    facts recomputed, fact order, whether the first fact served uses its lead encoding and
    whether the facts' keys are scaled (the server's key scales, if it has any)."""

    mode: str  # none, text, hit (text from vLLM's prefix cache) or inject
    k: int = 0
    w: int | None = None
    recompute: int | str = 0  # or "auto"
    order: str = "relevance"
    oracle: bool = False  # KV encoded with exactly its serving prefix (a diagnostic)
    context: str = "turns"
    lead: bool = True
    key_scales: float | None = None  # strength sent with the request (None: the server's)

    @property
    def name(self) -> str:
        order = "" if self.order == "relevance" else f" {self.order} order"
        if self.mode == "none":
            return "none"
        if self.mode == "text":
            return f"text k={self.k} (user w={self.window}){order}"
        if self.mode == "hit":
            return f"prefix hit k={self.k} (user w={self.window}){order}"
        window = "oracle" if self.oracle else self.window
        lead = "" if self.lead else " no-lead"
        scaled = ("" if self.key_scales is None else " unscaled" if self.key_scales == 0
                  else f" scales^{self.key_scales:g}")
        return f"inject k={self.k} w={window} m={self.recompute}{order}{lead}{scaled}"

    @property
    def encoding(self) -> tuple[str, int | None]:
        """Whose KV this configuration reads: (context, window)."""
        return self.context, self.w

    @property
    def window(self) -> str:
        return f"{self.w}" if self.context == "turns" else f"{self.w} {self.context}"

    def reference(self) -> Config:
        """The text configuration this one is compared with."""
        return Config("text", self.k, self.w, order=self.order, context=self.context)

    def prefix_hit(self) -> Config:
        """The prefix-hit configuration of this one's text prompt."""
        return Config("hit", self.k, self.w, order=self.order, context=self.context)


def configs(ks: list[int], encodings: list[tuple[str, int]], recomputes: list[int | str],
            order: str = "relevance", oracle: bool = False, leads: tuple[bool, ...] = (True,),
            key_scales: tuple[float | None, ...] = (None,),
            prefix_hit: bool = False) -> list[Config]:
    """none, then per k: text per encoding (its own user), its prefix hit (if asked, k > 0),
    inject per encoding, recompute (at most k), lead and key-scales choice, and the oracle
    window after the first encoding's text."""
    out = [Config("none")]
    for k in ks:
        for context, w in encodings:
            out.append(Config("text", k, w, order=order, context=context))
            if prefix_hit and k:
                out.append(out[-1].prefix_hit())
            if oracle and k and (context, w) == encodings[0]:
                out.append(Config("inject", k, w, 0, order, oracle=True, context=context))
            out += [Config("inject", k, w, m, order, context=context, lead=lead,
                           key_scales=scaled)
                    for m in _tails(recomputes, k) for lead in leads for scaled in key_scales]
    return out


def _tails(recomputes: list[int | str], k: int) -> list[int | str]:
    """The recomputes asked for at this k: counts (m > k: all k as text), then auto."""
    counts = sorted({min(m, k) for m in recomputes if isinstance(m, int)})
    return [*counts, *(["auto"] if "auto" in recomputes else [])]


def _ingest(settings: Settings, samples: list[dict], encoding: tuple[str, int], out_dir: Path,
            max_turns: int | None) -> dict:
    """Ingest every sample under encoding-specific user ids; returns sample_id -> user id."""
    context, window = encoding
    tag = uuid.uuid4().hex[:6]
    run = settings.model_copy(update={
        "window": window, "encode_context": context, "turns_topic": f"eval-{tag}",
        "dead_letter_topic": f"eval-{tag}.dlq", "consumer_group": f"eval-{tag}"})
    users = {s["sample_id"]: f"{s['sample_id']}-{context}{window}-{tag}" for s in samples}
    events, taken = [], dict.fromkeys(users, 0)
    for t in locomo_turns(samples):
        if max_turns is None or taken[t.user_id] < max_turns:
            taken[t.user_id] += 1
            user = users[t.user_id]
            events.append(t.model_copy(update={"user_id": user, "conversation_id": user}))

    async def go() -> None:
        bootstrap, security = resolve_kafka_bootstrap(run), kafka_security(run)
        await ensure_topics(bootstrap, [run.turns_topic, run.dead_letter_topic],
                            security=security)
        await publish_turns(bootstrap, run.turns_topic, events, security=security)
        engine = create_engine(run.database_url)
        try:
            for user in users.values():
                await wait_encoded(engine, user, sum(e.user_id == user for e in events), run)
        finally:
            await engine.dispose()

    with worker_process(run, out_dir / f"worker-{context}{window}.log",
                        sharing=1):  # the server starts after ingest
        asyncio.run(go())
    return users


async def answer(client: httpx.AsyncClient, url: str, user: str, question: str, config: Config,
                 max_tokens: int, salt: str | None = None) -> dict:
    """One streamed greedy answer (a fresh cache salt unless given): text, generated token ids,
    first-position top logprobs, TTFT and the fact ids the server used, in prompt order. A
    prefix-hit configuration is sent as text."""
    mode = "text" if config.mode == "hit" else config.mode
    got = await stream_chat(client, url, user, question, mode, config.k, max_tokens,
                            options={"recompute": config.recompute, "order": config.order,
                                     "lead": config.lead, **({} if config.key_scales is None else
                                                             {"key_scales": config.key_scales})},
                            top_logprobs=TOP_LOGPROBS, salt=salt)
    return {"prediction": got.text, "token_ids": got.token_ids, "first_top": got.first_top,
            "ttft_s": got.ttft, "fact_ids": got.headers.get("x-inferscale-fact-ids", ""),
            "recompute_auto": got.headers.get("x-inferscale-recompute-auto")}


class _Oracle:
    """Oracle-window owners for the questions (loads the encoder once)."""

    def __init__(self, settings: Settings):
        from inferscale.contracts.fingerprint import model_fingerprint
        from inferscale.core.model_prep import resolve_model_path
        from inferscale.kv.encoder import load_encoder
        from inferscale.kv.store import KVStore

        self.encoder = load_encoder(settings)
        fingerprint = model_fingerprint(resolve_model_path(settings))
        self.store = KVStore.from_settings(settings, fingerprint, 0)
        self.engine = create_engine(settings.database_url)
        self.tag = uuid.uuid4().hex[:6]

    async def answer(self, client: httpx.AsyncClient, url: str, question: str, config: Config,
                     text: dict, max_tokens: int) -> dict:
        from inferscale.lab.oracle import oracle_owner

        fact_ids = [int(i) for i in text["fact_ids"].split(",") if i]
        owner = f"oracle-{self.tag}-{uuid.uuid4().hex[:8]}"
        originals = await oracle_owner(self.engine, self.encoder, self.store, fact_ids, owner)
        got = await answer(client, url, owner, question, config, max_tokens)
        got["fact_ids"] = ",".join(str(originals.get(int(i), -1))
                                   for i in got["fact_ids"].split(",") if i)
        return got


async def _ask_all(url: str, items: list[dict], plan: list[Config], max_tokens: int,
                   settings: Settings, log: Path, warmup: int = 2) -> list[dict]:
    records = []
    log.unlink(missing_ok=True)
    oracle = _Oracle(settings) if any(c.oracle for c in plan) else None
    async with httpx.AsyncClient(timeout=600) as client:
        for item in items[:warmup]:  # compile and page-in warm-up, not timed
            for config in plan:
                if not config.oracle:
                    await answer(client, url, item["users"][config.encoding],
                                 item["question"], config, 2)
        for n, item in enumerate(items, 1):
            # Page the question's facts into the host tier first (one token, not timed), so no
            # inject configuration pays the first page-ins and the others none.
            for config in {Config("inject", c.k, c.w, context=c.context) for c in plan
                           if c.mode == "inject" and not c.oracle}:
                await answer(client, url, item["users"][config.encoding], item["question"],
                             config, 1)
            answers: dict[str, dict] = {}
            for config in plan:
                if config.oracle:
                    assert oracle is not None  # made where the plan has oracle configurations
                    got = await oracle.answer(client, url, item["question"], config,
                                              answers[config.reference().name], max_tokens)
                elif config.mode == "hit":  # the prompt once under a salt, then timed again
                    salt = uuid.uuid4().hex
                    user = item["users"][config.encoding]
                    await answer(client, url, user, item["question"], config, 1, salt)
                    got = await answer(client, url, user, item["question"], config, max_tokens,
                                       salt)
                else:
                    got = await answer(client, url, item["users"][config.encoding],
                                       item["question"], config, max_tokens)
                answers[config.name] = got
                records.append({"sample_id": item["sample_id"], "question": item["question"],
                                "answer": item["answer"],
                                "category": item["category"], "config": config.name,
                                "f1": locomo_f1(got["prediction"], item["answer"],
                                                item["category"]),
                                "em": exact_match(got["prediction"], item["answer"]), **got})
            with log.open("a") as f:
                f.writelines(json.dumps(r) + "\n" for r in records[-len(plan):])
            print(f"  answered {n}/{len(items)}", flush=True)
    if oracle:
        await oracle.engine.dispose()
    return records


def summarize(records: list[dict], plan: list[Config]) -> dict:
    """Per configuration: F1, EM, TTFT; inject and prefix-hit configurations also vs their text
    reference (agreement, the ratio of median TTFTs with its paired bootstrap interval), inject
    ones also over the prefix hit where the plan has it, their first token against either
    exact answer (text prefill's or the prefix hit's), and their agreement split by how each
    request was served (``served``: with KV, or as text by recompute auto)."""
    by_config = {c.name: [r for r in records if r["config"] == c.name] for c in plan}
    names = {c.name for c in plan}
    summary: dict[str, dict] = {}
    for config in plan:
        rows = by_config[config.name]
        ttfts = [r["ttft_s"] for r in rows]
        entry = {"f1": statistics.mean(r["f1"] for r in rows),
                 "em": statistics.mean(r["em"] for r in rows),
                 "ttft_p50_s": statistics.median(ttfts)}
        if config.mode in ("inject", "hit"):
            reference = by_config[config.reference().name]
            entry["vs_text"] = compare(reference, rows)
            entry["same_facts"] = statistics.mean(
                sorted(r["fact_ids"].split(",")) == sorted(t["fact_ids"].split(","))
                for r, t in zip(rows, reference, strict=True))
            entry["ttft_ratio_text_over_this"] = (
                summary[config.reference().name]["ttft_p50_s"] / entry["ttft_p50_s"])
            entry["ttft_ratio_text_over_this_ci95"] = list(
                bootstrap_median_ratio_ci([r["ttft_s"] for r in reference], ttfts))
        hit = config.prefix_hit().name
        if config.mode == "inject" and hit in names:
            hit_ttfts = [r["ttft_s"] for r in by_config[hit]]
            entry["ttft_ratio_this_over_hit"] = entry["ttft_p50_s"] / summary[hit]["ttft_p50_s"]
            entry["ttft_ratio_this_over_hit_ci95"] = list(
                bootstrap_median_ratio_ci(ttfts, hit_ttfts))
            entry["vs_exact"] = exact_path_agreement(reference, by_config[hit], rows)
        if config.mode == "inject":
            entry["served"] = served_as_kv(reference, rows, [r.get("recompute_auto") for r in rows],
                                           by_config[hit] if hit in names else None)
        if config.recompute == "auto":
            entry["auto"] = auto_costs([r.get("recompute_auto") for r in rows],
                                       [r["ttft_s"] for r in rows])
        summary[config.name] = entry
    return summary


def _print(summary: dict) -> None:
    rows = []
    for name, s in summary.items():
        v, served = s.get("vs_text"), s.get("served") or {}
        rows.append([name, s["f1"] * 100, s["ttft_p50_s"] * 1000,
                     s.get("ttft_ratio_this_over_hit", ""),
                     *([s["ttft_ratio_text_over_this"], v["first_token"],
                        served.get("first_token_kv", ""), served.get("served_as_text", ""),
                        v["first_4"], v["whole_answer"], v["first_token_kl"], v["f1_gap"] * 100,
                        "{:+.1f} .. {:+.1f}".format(*(x * 100 for x in v["f1_gap_ci95"]))]
                       if v else [""] * 9)])
    print_table(["config", "F1", "TTFT p50 ms", "this/hit TTFT", "text/this TTFT", "first token",
                 "of those served as KV", "as text", "first 4", "whole answer",
                 "KL first token", "F1 gap", "gap 95% CI"], rows)


def pick_questions(samples: list[dict], questions: int, seed: int) -> list[dict]:
    """``questions`` random QA items of categories 1-4 (seeded), each with its sample_id."""
    qa = [{**q, "sample_id": s["sample_id"]} for s in samples for q in s["qa"]
          if q.get("category") in (1, 2, 3, 4) and "answer" in q]
    return random.Random(seed).sample(qa, min(questions, len(qa)))


def run(settings: Settings, data: Path, out_dir: Path, conversations: tuple[int, ...] = (0,),
        questions: int = 100, ks: tuple[int, ...] = (20,), windows: tuple[int, ...] = (5,),
        contexts: tuple[str, ...] = ("turns",), recomputes: tuple[int | str, ...] = (0,),
        order: str = "relevance", oracle: bool = False, leads: tuple[bool, ...] = (True,),
        max_tokens: int = 32, max_turns: int | None = None, seed: int = 0,
        key_scales: tuple[float | None, ...] = (None,), prefix_hit: bool = False) -> dict:
    """Ingest the given conversations (indices into ``data``), serve, answer and score; prints a
    table and writes JSON (every answer is also appended to ``eval-fidelity.jsonl`` as it comes,
    so a run cut short keeps what it measured)."""
    dataset = json.loads(data.read_text())
    if not conversations or len(set(conversations)) != len(conversations) or not all(
            0 <= c < len(dataset) for c in conversations):
        raise ValueError(f"conversations must be distinct indices in [0, {len(dataset)}), "
                         f"got {list(conversations)}")
    samples = [dataset[c] for c in conversations]
    settings = prepare(settings)
    out_dir.mkdir(parents=True, exist_ok=True)
    encodings = [(c, w) for c in contexts for w in windows]
    users = {e: _ingest(settings, samples, e, out_dir, max_turns) for e in encodings}
    items = [{**q, "users": {Config("none").encoding: users[encodings[0]][q["sample_id"]],
                             **{e: users[e][q["sample_id"]] for e in encodings}}}
             for q in pick_questions(samples, questions, seed)]
    plan = configs(list(ks), encodings, list(recomputes), order, oracle, leads, key_scales,
                   prefix_hit)
    with server_process(settings, out_dir / "server.log") as url:
        records = asyncio.run(_ask_all(url, items, plan, max_tokens, settings,
                                       out_dir / "eval-fidelity.jsonl"))
    summary = summarize(records, plan)
    _print(summary)
    from inferscale.contracts.fingerprint import model_fingerprint
    from inferscale.core.model_prep import resolve_model_path
    from inferscale.serving.calibration import SETTINGS, calibrated

    model_path = resolve_model_path(settings)
    fingerprint = model_fingerprint(model_path)
    chosen, _ = calibrated(settings, fingerprint)  # what the server's recompute auto ran with
    report = {"model": model_path.name, "fingerprint": fingerprint,
              "settings_differing": settings_differing(settings),
              "recompute_auto_settings": {name: chosen.get(name, getattr(settings, name))
                                          for name in SETTINGS.values()},
              "data": str(data), "conversations": list(conversations), "questions": len(items),
              "ks": list(ks), "windows": list(windows),
              "contexts": list(contexts), "recomputes": list(recomputes), "order": order,
              "leads": list(leads), "key_scales": list(key_scales), "prefix_hit": prefix_hit,
              "key_scales_setting": settings.key_scales,
              "key_scale_strength_setting": settings.key_scale_strength,
              "max_tokens": max_tokens,
              "max_turns": max_turns, "encode_dtype": settings.encode_dtype,
              "extractor": settings.extractor, "summary": summary,
              "records": records}
    write_report(out_dir, "eval-fidelity", report)
    return report
