"""Key scales: a per-layer temperature for the attention the prompt pays to injected facts.

Facts encoded apart from each other (after their neighbours, not after the facts served before
them) draw more attention from the question than the same facts prefilled as text: on LoCoMo,
scaling every fact key by 0.9 lowers the drift (KL of the first-token distribution) by a
quarter, by 1.1 doubles it. ``inferscale calibrate`` fits one scale per layer on held-out
conversations (``calibrate.py``); the connector multiplies the rotated keys of every injected
fact (not the preamble's, which is exact) by its layer's scale, and ``eval drift`` does the same
offline. Scaling a key by s divides the temperature of its attention logits by s; values and
the question's own keys are untouched.

A scales file is JSON: ``{"model": <model folder name>, "scales": [one per layer], ...}`` (other
keys: provenance). ``INFERSCALE_KEY_SCALES``: ``auto`` (the file shipped for the served model,
``inferscale/data/key_scales/<model folder name>.json``, when there is one), ``off``, or a path.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

SHIPPED_DIR = Path(__file__).parent / "data" / "key_scales"
MIN_SCALE, MAX_SCALE = 0.25, 4.0
MAX_FILE_BYTES = 1 << 20


class KeyScalesError(ValueError):
    """A key-scales file or setting that cannot be used."""


@dataclass(frozen=True)
class KeyScales:
    """One scale per layer for injected fact keys, and where they came from."""

    scales: tuple[float, ...]
    source: str

    def tensor(self, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
               ) -> torch.Tensor:
        return torch.tensor(self.scales, dtype=dtype, device=device)


def parse_key_scales(raw: object, layers: int, source: str) -> KeyScales:
    """Validate a decoded scales file for a model with ``layers`` layers."""
    if not isinstance(raw, dict) or not isinstance(raw.get("scales"), list):
        raise KeyScalesError(f"{source}: expected an object with a 'scales' list")
    scales = raw["scales"]
    if len(scales) != layers:
        raise KeyScalesError(f"{source}: {len(scales)} scales for a model with {layers} layers")
    for value in scales:
        if type(value) not in (int, float) or not math.isfinite(value) or not (
                MIN_SCALE <= value <= MAX_SCALE):
            raise KeyScalesError(f"{source}: every scale must be a number in "
                                 f"[{MIN_SCALE}, {MAX_SCALE}], got {str(value)[:40]!r}")
    return KeyScales(tuple(float(v) for v in scales), source)


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


def key_factor(scales: torch.Tensor, scaled: torch.Tensor) -> torch.Tensor:
    """Per-(layer, token) multipliers ``[layers, tokens, 1, 1]`` for keys
    ``[layers, tokens, heads, head_dim]``: the layer's scale where ``scaled [tokens]`` is true
    (an injected fact's token), 1 elsewhere."""
    one = torch.ones((), dtype=scales.dtype, device=scales.device)
    return torch.where(scaled.to(scales.device)[None, :], scales[:, None], one)[..., None, None]
