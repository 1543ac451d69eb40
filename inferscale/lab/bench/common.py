"""Shared helpers for benchmark output."""

from __future__ import annotations

import json
import platform
import statistics
from pathlib import Path

import torch

from inferscale.core.settings import Settings

# Where a run's infrastructure, files and secrets are: not settings a figure depends on.
_PLACES = {"kafka_bootstrap", "database_url", "data_dir", "kafka_sasl_password", "llm_api_key",
           "turns_topic", "dead_letter_topic", "consumer_group", "worker_http_host",
           "worker_http_port", "model_path", "kv_dir", "kv_url", "server_host", "server_port",
           "api_keys", "vllm_api_keys", "plan_secret"}

def machine() -> dict:
    """What the figures were measured on."""
    import os

    return {"cpu_count": os.cpu_count(), "platform": platform.platform(),
            "torch": torch.__version__, "cuda": torch.cuda.is_available()}


def settings_differing(settings: Settings) -> dict:
    """The settings whose values differ from their defaults (secrets and where the run's
    infrastructure and files are left out), as JSON values."""
    dumped = settings.model_dump(mode="json")
    out = {}
    for name, field in Settings.model_fields.items():
        if name in _PLACES:
            continue
        default = field.get_default(call_default_factory=True)
        if dumped[name] != Settings.model_validate({name: default}).model_dump(mode="json")[name]:
            out[name] = dumped[name]
    return out


def source() -> dict:
    """The commit the figures were made with (and whether the tree had changes), where the
    package runs from a git checkout; None outside one."""
    import subprocess

    root = Path(__file__).resolve().parents[3]
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], check=True,
                                capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain",
                                "--untracked-files=no"], check=True, capture_output=True,
                               text=True, timeout=10).stdout.strip() != ""
    except (OSError, subprocess.SubprocessError):
        return {"commit": None}
    return {"commit": commit, "dirty": dirty}


def percentile(values: list[float], q: int) -> float | None:
    """The q-th percentile (inclusive method); the value itself for one sample, None for none."""
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def write_report(out_dir: Path, name: str, report: dict) -> Path:
    """Save a benchmark report as JSON (with the machine and the commit); returns the path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), "source": source(), **report}, indent=2))
    return path


def print_table(headers: list[str], rows: list[list]) -> None:
    """A plain aligned table on stdout."""
    cells = [[str(h) for h in headers]] + [[f"{c:.3f}" if isinstance(c, float) else str(c)
                                            for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for n, row in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
        if n == 0:
            print("  ".join("-" * w for w in widths))


def auto_costs(decisions: list[str | None], ttfts: list[float]) -> dict | None:
    """Under recompute auto (each request's ``x-inferscale-recompute-auto``: kept, recomputed or
    text): the share of each later attempt (answered again with the tail recomputed, or with
    every fact as text), the mean TTFT and the TTFT (p50 / p99) of each outcome; None where no
    request was under recompute auto."""
    if not any(decisions):
        return None
    out: dict = {"recomputed_share": decisions.count("recomputed") / len(decisions),
                 "text_share": decisions.count("text") / len(decisions),
                 "ttft_mean_s": statistics.mean(ttfts)}
    for decision in ("kept", "recomputed", "text"):
        chosen = [t for t, d in zip(ttfts, decisions, strict=True) if d == decision]
        out[f"ttft_{decision}_p50_s"] = statistics.median(chosen) if chosen else None
        out[f"ttft_{decision}_p99_s"] = percentile(chosen, 99)
    return out
