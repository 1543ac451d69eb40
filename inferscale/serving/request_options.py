"""Per-request memory options: one pydantic model, read from the body's ``"inferscale"``
object, else the ``X-InferScale-*`` headers, else the server's settings.

``mode``: ``inject`` (KV), ``text`` (the same facts prefilled as text) or ``none``; ``k``: facts
retrieved; ``recompute``: the best m facts prefilled after the injected ones, or ``auto``
(``auto_recompute.py``) with ``recompute_margin`` its threshold in nats and
``recompute_text_margin`` the tail-recomputed answer's, under which every fact goes as text;
``order``: ``relevance`` (best last) or ``time`` (stored order); ``lead``: the first injected
fact uses its lead encoding where it has one; ``key_scales``: how strongly the connector
applies its key scales, true / false or a strength in [0, 1]; ``agent_id`` / ``run_id``:
retrieve only the owner's facts of that agent / run (``contracts/scope.py``; unset: any);
``filters`` (the body's only): retrieve only facts passing the filter (``contracts/filters.py``,
as the memory API's search); ``record``: the new messages and the answer are stored as turns of
the owner once answered (``conversation_record.py``; needs a key that may write). The lab's CLI
parses strengths with the same type (``STRENGTH``).
"""

from __future__ import annotations

from functools import cached_property
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, TypeAdapter, ValidationError

from inferscale.contracts.filters import EVERYTHING, FilterError, Node, parse_filter
from inferscale.contracts.scope import Scope, ScopeValue, is_owner_id
from inferscale.core.settings import Settings
from inferscale.serving.guards import FrontendError

MAX_K = 200
# A first-token margin is a few nats (fp32 logprobs end near -1e4): past this bound every answer
# is "unsure" already. An auto request costs at most three attempts, whatever the margins.
MAX_MARGIN = 1000.0
HEADERS = {"mode": "x-inferscale-memory", "k": "x-inferscale-k",
           "recompute": "x-inferscale-recompute",
           "recompute_margin": "x-inferscale-recompute-margin",
           "recompute_text_margin": "x-inferscale-recompute-text-margin",
           "order": "x-inferscale-order",
           "lead": "x-inferscale-lead", "key_scales": "x-inferscale-key-scales",
           "agent_id": "x-inferscale-agent-id", "run_id": "x-inferscale-run-id",
           "record": "x-inferscale-record"}


def _strength(raw: object) -> object:
    """true / false (a header's text too) as 1 / 0; anything else is left to the float check."""
    if isinstance(raw, bool):
        return float(raw)
    if isinstance(raw, str) and raw.lower() in ("true", "false"):
        return 1.0 if raw.lower() == "true" else 0.0
    return raw


def _flag(raw: object) -> object:
    """true / false / 1 / 0 as text (a header's value) read as a bool; bools stay; anything
    else fails the strict bool check (no "yes", no numbers)."""
    if isinstance(raw, str) and raw.lower() in ("true", "false", "1", "0"):
        return raw.lower() in ("true", "1")
    return raw


Strength = Annotated[float, BeforeValidator(_strength),
                     Field(ge=0.0, le=1.0, allow_inf_nan=False)]
Flag = Annotated[bool, BeforeValidator(_flag), Field(strict=True)]
STRENGTH: TypeAdapter[float] = TypeAdapter(Strength)
Count = Annotated[int, Field(ge=0, le=MAX_K)]
Margin = Annotated[float, Field(ge=0.0, le=MAX_MARGIN, allow_inf_nan=False)]


class MemoryOptions(BaseModel):
    """Per-request memory choices (see the module's docstring)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: Literal["inject", "text", "none"]
    k: Count
    recompute: Count | Literal["auto"] = 0
    recompute_margin: Margin = 0.5
    recompute_text_margin: Margin = 0.125
    order: Literal["relevance", "time"] = "relevance"
    lead: Flag = True
    key_scales: Strength = 1.0
    agent_id: ScopeValue | None = None
    run_id: ScopeValue | None = None
    filters: dict[str, Any] | None = None
    record: Flag = False

    @property
    def scope(self) -> Scope:
        return Scope(self.agent_id, self.run_id)

    @cached_property
    def where(self) -> Node:
        """The filter as a tree, parsed once (``owner_and_options`` refused one that does not
        parse)."""
        return EVERYTHING if self.filters is None else parse_filter(self.filters)


def default_recompute(settings: Settings) -> int | Literal["auto"]:
    """The server's tail recompute: as set, else auto without a GPU and the auto tail on every
    request with one."""
    if settings.recompute_tail is not None:
        return settings.recompute_tail
    import torch

    return settings.recompute_auto_tail if torch.cuda.is_available() else "auto"


# vLLM's other generation routes: memory is not served there.
WITHOUT_MEMORY = frozenset({"/v1/completions", "/v1/messages",
                            "/v1/chat/completions/batch", "/inference/v1/generate"})


def refuse_memory_elsewhere(path: str, data: object, headers: dict[str, str]) -> None:
    """Memory is served on chat completions and responses only: a request to another generation
    route (``WITHOUT_MEMORY``) that asks for it (an ``"inferscale"`` object, ``X-InferScale-
    User`` or an option's header; ``user`` alone is OpenAI's end-user id there) gets a 400
    naming the route, never an answer without the memory it asked for."""
    if path not in WITHOUT_MEMORY:
        return
    named = {"x-inferscale-user", *HEADERS.values()} & set(headers)
    if named or (isinstance(data, dict) and "inferscale" in data):
        raise FrontendError(400, f"memory is served on /v1/chat/completions and /v1/responses "
                                 f"only, not on "
                                 f"{path[:100]!r} (asked for by "
                                 f"{sorted(named) or ['the inferscale object']})")


def request_owner(data: dict, headers: dict[str, str]) -> str | None:
    """The memory owner (``X-InferScale-User``, else ``user``; None: no memory); 400 where it
    is not an owner id."""
    owner = headers.get("x-inferscale-user") or data.get("user")
    if owner is not None and not is_owner_id(owner):
        raise FrontendError(400, "the memory owner must be a string of 1-256 characters, no "
                                 "control characters")
    return owner


def owner_and_options(data: dict, headers: dict[str, str], settings: Settings,
                      record: bool | None = None) -> tuple[str | None, MemoryOptions]:
    """The memory owner (``request_owner``) and the options (the body's ``"inferscale"``
    object is removed from ``data``; ``record``: the caller's key's default, over the
    server's); 400 for anything invalid."""
    owner = request_owner(data, headers)
    given = data.pop("inferscale", None) or {}
    if not isinstance(given, dict):
        raise FrontendError(400, "'inferscale' must be an object like {\"mode\": \"inject\"}")
    given = dict(given)
    filters = given.pop("filters", None)
    defaults = {"mode": settings.memory_mode, "k": settings.top_k,
                "recompute": default_recompute(settings),
                "recompute_margin": settings.recompute_auto_margin,
                "recompute_text_margin": settings.recompute_auto_text_margin,
                "order": settings.fact_order,
                "lead": settings.lead_encoding,
                "key_scales": settings.key_scale_strength if settings.key_scales != "off"
                else 0.0, "agent_id": None, "run_id": None,
                "record": settings.record_conversations if record is None else record}
    raw = {name: given[name] if given.get(name) is not None else headers.get(header,
                                                                           defaults[name])
           for name, header in HEADERS.items()}
    unknown = sorted(map(str, set(given) - set(HEADERS)))
    if unknown:
        raise FrontendError(400, f"unknown memory options {unknown}; known: "
                                 f"{sorted([*HEADERS, 'filters'])}")
    try:
        options = MemoryOptions.model_validate({**raw, "filters": filters})
        options.where  # noqa: B018 - parsed once here, so a bad filter is a 400
        return owner, options
    except FilterError as exc:
        raise FrontendError(400, f"invalid memory option 'filters': {exc}") from None
    except ValidationError as exc:
        error = exc.errors()[0]
        name = ".".join(map(str, error["loc"])) or "options"
        raise FrontendError(400, f"invalid memory option {name!r}: {error['msg']} "
                                 f"(got {str(error.get('input'))[:40]!r})") from None
