"""Key scales: a per-layer temperature for the attention the prompt pays to injected facts.

Facts encoded apart from each other (after their neighbours, not after the facts served before
them) draw a different share of the question's attention than the same facts prefilled as text,
and more so the more facts are injected: on LoCoMo at k = 50, scaling every fact key by 0.9
lowers the drift (KL of the first-token distribution) by a quarter, by 1.1 doubles it.
``inferscale calibrate`` fits one scale per layer at a given number of injected facts, on
conversations kept out of evaluation (``calibrate.py``); the connector multiplies the rotated
keys of every injected fact (not the preamble's, which is exact) by its layer's scale for the
request's fact count, and ``eval drift`` does the same offline. Scaling a key by s divides the
temperature of its attention logits by s; values and the question's own keys are untouched.

A scales file is JSON: ``{"model": <model folder name>, "points": [{"facts": n, "scales": [one
per layer], "fit": {...}}, ...], ...}`` (other keys: provenance); between fitted fact counts the
log-scales are interpolated. ``INFERSCALE_KEY_SCALES``: ``auto`` (the file shipped for the
served model, ``inferscale/data/key_scales/<model folder name>.json``, when there is one),
``off``, or a path.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

SHIPPED_DIR = Path(__file__).parent.parent / "data" / "key_scales"
MIN_SCALE, MAX_SCALE = 0.25, 4.0
MAX_FILE_BYTES = 1 << 20
MAX_FACTS = 10_000


class KeyScalesError(ValueError):
    """A key-scales file or setting that cannot be used."""


@dataclass(frozen=True)
class KeyScales:
    """Per-layer scales for injected fact keys, fitted at several fact counts, and where they
    came from. ``points``: (facts, scales per layer), ascending in facts."""

    points: tuple[tuple[int, tuple[float, ...]], ...]
    source: str

    @functools.cached_property
    def _logs(self) -> list[torch.Tensor]:
        """Each point's log-scales (made once: ``for_facts`` runs per injected request)."""
        return [torch.tensor(scales, dtype=torch.float64).log() for _, scales in self.points]

    def at_strength(self, strength: float) -> KeyScales:
        """Every scale raised to ``strength`` (what the server applies: since scales are
        interpolated in log space, ``for_facts`` of the result is ``for_facts ** strength``)."""
        return KeyScales(tuple((facts, tuple(s ** strength for s in scales))
                               for facts, scales in self.points),
                         f"{self.source} ^ {strength:g}")

    def for_facts(self, facts: int) -> torch.Tensor:
        """The per-layer scales [layers] for a prompt that injects ``facts`` facts: log-linear
        in ``facts`` between fitted points, toward no scaling below the first (1 at 0 facts),
        the last point's beyond it."""
        counts, logs = [count for count, _ in self.points], self._logs
        if facts >= counts[-1]:
            log_scales = logs[-1]
        elif facts <= counts[0]:
            log_scales = logs[0] * max(facts, 0) / counts[0]
        else:
            i = next(j for j in range(1, len(counts)) if facts <= counts[j])
            share = (facts - counts[i - 1]) / (counts[i] - counts[i - 1])
            log_scales = logs[i - 1] * (1 - share) + logs[i] * share
        return log_scales.exp().float()


def _scales(value: object, layers: int, where: str) -> tuple[float, ...]:
    if not isinstance(value, list) or len(value) != layers:
        raise KeyScalesError(f"{where}: expected {layers} scales (one per layer)")
    for scale in value:
        if type(scale) not in (int, float) or not math.isfinite(scale) or not (
                MIN_SCALE <= scale <= MAX_SCALE):
            raise KeyScalesError(f"{where}: every scale must be a number in "
                                 f"[{MIN_SCALE}, {MAX_SCALE}], got {str(scale)[:40]!r}")
    return tuple(float(scale) for scale in value)


def parse_key_scales(raw: object, layers: int, source: str) -> KeyScales:
    """Validate a decoded scales file for a model with ``layers`` layers: ``{"points":
    [{"facts": n, "scales": [...]}, ...], ...}``, at most one point per fact count."""
    if not isinstance(raw, dict) or not isinstance(raw.get("points"), list) or not raw["points"]:
        raise KeyScalesError(f"{source}: expected an object with a non-empty 'points' list")
    points: dict[int, tuple[float, ...]] = {}
    for point in raw["points"]:
        if not isinstance(point, dict):
            raise KeyScalesError(f"{source}: a point must be an object")
        facts = point.get("facts")
        if type(facts) is not int or not 1 <= facts <= MAX_FACTS or facts in points:
            raise KeyScalesError(f"{source}: 'facts' must be distinct integers in "
                                 f"[1, {MAX_FACTS}], got {str(facts)[:40]!r}")
        points[facts] = _scales(point.get("scales"), layers, f"{source}, facts={facts}")
    return KeyScales(tuple(sorted(points.items())), source)


def load_key_scales(path: Path, layers: int) -> KeyScales:
    """Read and validate a scales file."""
    if not path.is_file():  # missing, a directory, a FIFO or a device such as /dev/zero
        raise KeyScalesError(f"key scales {path}: not a regular file")
    try:
        with path.open("rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
        if len(data) > MAX_FILE_BYTES:
            raise KeyScalesError(f"key scales {path}: larger than {MAX_FILE_BYTES} bytes")
        raw = json.loads(data.decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        if isinstance(exc, KeyScalesError):
            raise
        raise KeyScalesError(f"cannot read key scales {path}: {exc}") from None
    return parse_key_scales(raw, layers, str(path))


def resolve_key_scales(setting: str, model_dir: Path | str, layers: int) -> KeyScales | None:
    """The scales ``INFERSCALE_KEY_SCALES`` selects for the model in ``model_dir`` (None: off, or
    ``auto`` and nothing shipped for this model)."""
    if setting == "off":
        return None
    if setting == "auto":
        shipped = SHIPPED_DIR / f"{Path(model_dir).name}.json"
        return load_key_scales(shipped, layers) if shipped.is_file() else None
    return load_key_scales(Path(setting), layers)


def resolve_for_server(setting: str, model_dir: Path) -> str:
    """The setting a server process gets: the scales file's path, or "off" (``auto`` with
    nothing shipped). Raises ``KeyScalesError`` for a file that cannot be used."""
    try:
        layers = int(json.loads((model_dir / "config.json").read_text())["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise KeyScalesError(f"cannot read the layer count of {model_dir}: {exc}") from None
    scales = resolve_key_scales(setting, model_dir, layers)
    return scales.source if scales else "off"


def key_factor(runs: Sequence[tuple[torch.Tensor | None, int]], layers: int,
               device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
               ) -> torch.Tensor:
    """Per-(layer, token) multipliers ``[layers, tokens]`` for keys ``[layers, tokens, heads,
    head_dim]`` made of consecutive runs of tokens: (scales [layers], or None for unscaled
    tokens such as the preamble's, run length)."""
    one = torch.ones(layers, device=device, dtype=dtype)
    return torch.cat([(one if scales is None else scales.to(device, dtype))[:, None].expand(
        layers, length) for scales, length in runs], dim=1)
