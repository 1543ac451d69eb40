"""A served model's calibration: the recompute-auto policy fitted for that exact model.

Recompute auto (``auto_recompute.py``) keeps an injected answer whose first-token top-2 margin
reaches ``margin``, else answers again with the best ``tail`` facts prefilled, and answers a
third time with every fact as text where that margin is under ``text_margin`` (at once, the
tail skipped, where the first margin is under ``direct_margin``). How often the
injected first token follows text prefill's at a given margin is a property of the model: the
margins that give SmolLM2-135M 95% leave Gemma 3 270M at 81%. ``inferscale calibrate
recompute`` (the lab) replays the policy over answers of calibration conversations and writes a
profile; the server uses the profile made for its model's fingerprint and says so at start.

A profile is JSON: ``{"model": <folder name>, "fingerprint": <sha256 of the model>,
"recompute": {"margin": nats, "text_margin": nats, "tail": facts, "direct_margin": nats}, "fit":
{...}}`` (``direct_margin`` optional, 0 by default)
(``fit``: what it was fitted on and reached; only ``fit.reached`` and ``fit.target`` are read,
for the start-up line). Where it is looked
for (``INFERSCALE_CALIBRATION``): ``auto`` (``<data_dir>/calibration/<fingerprint>.json``, else
a shipped profile, ``inferscale/data/calibration/*.json``, whose fingerprint is the model's),
``off``, or a path. A profile made for another fingerprint is never used. A model without a
profile runs with ``UNCALIBRATED``: a wide text step that trades speed for agreement.
Settings the operator set (``INFERSCALE_RECOMPUTE_AUTO_*``) win over both.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from inferscale.core.settings import Settings

log = logging.getLogger("inferscale.serving.calibration")
SHIPPED_DIR = Path(__file__).parent.parent / "data" / "calibration"
MAX_FILE_BYTES = 1 << 20
SETTINGS = {"margin": "recompute_auto_margin", "text_margin": "recompute_auto_text_margin",
            "tail": "recompute_auto_tail", "direct_margin": "recompute_auto_direct_margin"}
Nats = Annotated[float, Field(ge=0.0, le=1000.0, allow_inf_nan=False)]


class CalibrationError(ValueError):
    """A calibration file or setting that cannot be used."""


class RecomputePolicy(BaseModel):
    """Recompute auto's thresholds (nats) and tail (facts); numbers only, no text."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    margin: Nats
    text_margin: Nats
    tail: int = Field(ge=0, le=200)
    direct_margin: Nats = 0.0  # an m = 0 margin under it: text at once, the tail skipped


class Reached(BaseModel):
    """What the fitted policy reached on the calibration answers (more figures allowed)."""

    model_config = ConfigDict(frozen=True, extra="allow")

    first_token: float = Field(ge=0.0, le=1.0)  # share equal to text prefill's first token
    n: int = Field(ge=1)  # answers it was fitted on


class Target(BaseModel):
    """What the fit aimed at, and whether it got there (more figures allowed; no text for
    numbers or flags)."""

    model_config = ConfigDict(frozen=True, extra="allow", strict=True)

    first_token: float = Field(ge=0.0, le=1.0)
    reached: bool


class Fit(BaseModel):
    """How a profile was made (provenance, the frontier, ...: more keys allowed)."""

    model_config = ConfigDict(frozen=True, extra="allow")

    reached: Reached | None = None
    target: Target | None = None


class Profile(BaseModel):
    """One model's calibration file."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = Field(min_length=1, max_length=256)
    fingerprint: str = Field(pattern=r"^[0-9a-f]{64}$")
    recompute: RecomputePolicy
    fit: Fit = Field(default_factory=Fit)


# No profile for the served model: keep the tail step of the model the defaults were measured on,
# and send every answer still unsure after it (a margin under 0.5 nats) to text. On Gemma 3 270M
# this text step alone took first-token agreement from 82% to 96% at 1.85x text prefill's mean
# TTFT (docs/results/models.md); on a calibrated model it is never slower to have a profile.
UNCALIBRATED = RecomputePolicy(margin=0.5, text_margin=0.5, tail=2)


def read_profile(path: Path) -> Profile:
    """A profile file, validated (``CalibrationError`` naming the file and what is wrong)."""
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            raise CalibrationError(f"{path}: larger than {MAX_FILE_BYTES} bytes")
        return Profile.model_validate(json.loads(path.read_bytes()))
    except (OSError, ValueError) as exc:  # ValidationError and JSONDecodeError are ValueErrors
        if isinstance(exc, CalibrationError):
            raise
        detail = (exc.errors()[0]["msg"] if isinstance(exc, ValidationError) else str(exc))
        raise CalibrationError(f"{path}: not a calibration profile ({detail[:200]})") from None


def profile_path(data_dir: Path, fingerprint: str) -> Path:
    """Where ``inferscale calibrate recompute`` writes, and the server first looks."""
    return data_dir / "calibration" / f"{fingerprint}.json"


def find_profile(setting: str, data_dir: Path, fingerprint: str) -> Profile | None:
    """The profile the setting names for a model (None: ``off``, or none made for it).
    A named path must hold a profile of this fingerprint."""
    if setting == "off":
        return None
    if setting != "auto":
        profile = read_profile(Path(setting).expanduser())
        if profile.fingerprint != fingerprint:
            raise CalibrationError(f"{setting}: made for model {profile.model} "
                                   f"({profile.fingerprint[:16]}), not the served model "
                                   f"({fingerprint[:16]})")
        return profile
    own = profile_path(data_dir, fingerprint)
    if own.exists():
        return read_profile(own)
    for shipped in sorted(SHIPPED_DIR.glob("*.json")):
        profile = read_profile(shipped)
        if profile.fingerprint == fingerprint:
            return profile
    return None


def calibrated(settings: Settings, fingerprint: str) -> tuple[dict[str, Any], str]:
    """The recompute settings to serve with (those the operator set are kept) and a line that
    says which were chosen and why."""
    profile = find_profile(settings.calibration, settings.data_dir, fingerprint)
    policy = profile.recompute if profile else UNCALIBRATED
    chosen = {SETTINGS[name]: value for name, value in policy.model_dump().items()
              if SETTINGS[name] not in settings.model_fields_set}
    kept = sorted(set(SETTINGS.values()) - set(chosen))
    values = ", ".join(f"{name} {value:g}" for name, value in
                       {**{n: getattr(settings, n) for n in kept}, **chosen}.items())
    if profile:
        reached, target = profile.fit.reached, profile.fit.target
        where = (f"calibration for {profile.model} ({profile.fingerprint[:16]})"
                 + (f": first token = text prefill's on {reached.first_token:.1%} of "
                    f"{reached.n} calibration answers" if reached else "")
                 + (f", short of its {target.first_token:.0%} target" if target
                    and not target.reached else ""))
    else:
        where = ("no calibration for this model: conservative settings (unsure answers go to "
                 "text; `inferscale calibrate recompute` fits this model's)")
    overridden = f"; set by you: {', '.join(kept)}" if kept else ""
    return chosen, f"recompute auto: {values} ({where}{overridden})"
