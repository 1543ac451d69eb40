"""Metadata on facts: an application's JSON object, bounded so that no request can make a row,
a response or the server's in-process index large or slow (migration 0014).

A metadata object is at most ``MAX_METADATA_BYTES`` as compact JSON, nested at most
``MAX_DEPTH`` deep, with at most ``MAX_KEYS`` keys in all; keys are 1-``MAX_KEY_CHARS``
characters without control characters; strings are valid text without NUL (Postgres's
``jsonb`` holds neither a NUL nor a lone surrogate);
numbers are finite, integers within 64 bits (``jsonb`` and the filters compare them as doubles).
"""

from __future__ import annotations

import json
import math
import re
from typing import Annotated, Any, Final

from pydantic import AfterValidator

MAX_METADATA_BYTES: Final = 4096
MAX_DEPTH: Final = 4  # the object itself is depth 1
MAX_KEYS: Final = 64
MAX_KEY_CHARS: Final = 128
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def check_metadata(value: dict[str, Any]) -> dict[str, Any]:
    """``value`` if it is metadata within the bounds; else ValueError naming the bound."""
    if not isinstance(value, dict):
        raise ValueError("metadata is a JSON object")
    keys = 0
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list) and depth > MAX_DEPTH:
            raise ValueError(f"metadata nests at most {MAX_DEPTH} deep")
        if isinstance(item, dict):
            keys += len(item)
            if keys > MAX_KEYS:
                raise ValueError(f"metadata has at most {MAX_KEYS} keys in all")
            for key, child in item.items():
                if (not isinstance(key, str) or not 1 <= len(key) <= MAX_KEY_CHARS
                        or _CONTROL.search(key) or not is_text(key)):
                    raise ValueError(f"metadata keys are 1-{MAX_KEY_CHARS} characters without "
                                     "control characters")
                stack.append((child, depth + 1))
        elif isinstance(item, list):
            stack.extend((child, depth + 1) for child in item)
        elif isinstance(item, str):
            if "\x00" in item or not is_text(item):
                raise ValueError("metadata strings are valid text without NUL")
        elif isinstance(item, bool) or item is None:
            pass
        elif isinstance(item, int):
            if not -2**63 <= item < 2**63:
                raise ValueError("metadata integers are within 64 bits")
        elif isinstance(item, float):
            if not math.isfinite(item):
                raise ValueError("metadata numbers are finite")
        else:
            raise ValueError(f"metadata holds JSON values only, not {type(item).__name__}")
    if len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()) > (
            MAX_METADATA_BYTES):
        raise ValueError(f"metadata is at most {MAX_METADATA_BYTES} bytes as JSON")
    return value


def is_text(text: str) -> bool:
    """Whether a string is valid text (no lone surrogate, as JSON's "\\ud800" gives)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


Metadata = Annotated[dict[str, Any], AfterValidator(check_metadata)]
