"""Hostile inputs: hypothesis strategies for turn records, and counts of inputs tried.

``tried("event parser", n)`` adds to a process-wide tally; when ``INFERSCALE_HOSTILE_REPORT``
names a file, the tally is appended to it as one JSON line at exit
(``{"entry point": inputs tried, ...}``), so several test runs add up in one file.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
from collections import Counter
from datetime import UTC, datetime, timedelta, timezone

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

TRIED: Counter[str] = Counter()
FIELDS = ("version", "user_id", "conversation_id", "turn_id", "speaker", "text", "timestamp")


def tried(entry_point: str, n: int = 1) -> None:
    """Count ``n`` more hostile inputs sent to ``entry_point``."""
    TRIED[entry_point] += n


def open_under(folder: os.PathLike[str] | str) -> list[str]:
    """The files under ``folder`` this process holds open (a check that nothing leaked)."""
    paths = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile
            paths.append(os.readlink(f"/proc/self/fd/{fd}"))
    return [path for path in paths if path.startswith(f"{folder}/")]


def _dump() -> None:
    path = os.environ.get("INFERSCALE_HOSTILE_REPORT")
    if path and TRIED:
        with open(path, "a") as report:
            report.write(json.dumps(dict(sorted(TRIED.items()))) + "\n")


atexit.register(_dump)

# Any code point, lone surrogates and NUL included.
any_text = st.text(st.characters(), max_size=40)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | any_text,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(any_text, inner, max_size=5),
    max_leaves=25,
)
offsets = st.integers(-1439, 1439).map(lambda m: timezone(timedelta(minutes=m)))
safe_text = st.characters(codec="utf-8", exclude_characters="\x00")
# ids (owners, scopes): no control characters (``contracts/scope.ID_PATTERN``)
ids = st.text(st.characters(codec="utf-8", exclude_categories=["Cc", "Cs"]), min_size=1,
              max_size=256)


@st.composite
def valid_events(draw) -> dict:
    """The JSON object of a valid turn event, v1 or v2 with or without scopes (naive or offset
    timestamps, any script)."""
    stamp = draw(st.datetimes(datetime(1, 1, 2), datetime(9999, 12, 30),
                              timezones=st.none() | offsets | st.just(UTC)))
    version = draw(st.sampled_from([1, 2]))
    scopes = {} if version == 1 else draw(st.fixed_dictionaries(
        {}, optional={"agent_id": ids | st.none(), "run_id": ids | st.none()}))
    return {"version": version, "user_id": draw(ids), "conversation_id": draw(ids),
            "turn_id": draw(ids), "speaker": draw(ids),
            "text": draw(st.text(safe_text, max_size=300)), "timestamp": stamp.isoformat(),
            **scopes}


# Raw JSON text for one value: what a broken or malicious producer could put in a field.
hostile_fragments = st.one_of(
    json_values.map(json.dumps),  # surrogates escaped as \ud800
    json_values.map(lambda v: json.dumps(v, ensure_ascii=False)),  # surrogates as raw bytes
    st.integers(4301, 12000).map(lambda n: "9" * n),  # past Python's int digit limit
    st.integers(900, 120000).map(lambda d: "[" * d + "]" * d),  # nesting past the recursion limit
    st.integers(900, 60000).map(lambda d: '{"a":' * d + "0" + "}" * d),
    st.text(st.characters(categories=["Cs"]), min_size=1, max_size=5).map(json.dumps),
    st.integers(0, 40000).map(lambda n: json.dumps("x" * n)),  # around the text size limit
    st.sampled_from(["1e999", "-1e999", "NaN", "Infinity", "-0", "1.0", "true", '""', '"\\u0000"',
                     '"9999-12-31T23:59:59-01:00"', '"0001-01-01T00:00:00+01:00"',
                     '"9999-12-31T23:59:59.999999-23:59"', '"0000-01-01T00:00:00Z"',
                     '"10000-01-01T00:00:00Z"', '"2025-02-30T00:00:00Z"', "253402300800",
                     "-62135596801", "1e20", '"2025-01-01T00:00:00+24:00"']),
)


@st.composite
def mutated_events(draw) -> bytes:
    """A valid event with some fields replaced by hostile JSON, dropped, or extra ones added."""
    event = {name: json.dumps(value, ensure_ascii=False)
             for name, value in draw(valid_events()).items()}
    for name in draw(st.lists(st.sampled_from(FIELDS), min_size=1, max_size=3, unique=True)):
        if draw(st.booleans()):
            event[name] = draw(hostile_fragments)
        else:
            del event[name]
    for name in draw(st.lists(any_text, max_size=2)):
        event[json.dumps(name)] = draw(hostile_fragments)
    body = ",".join(f"{json.dumps(name) if name in FIELDS else name}:{value}"
                    for name, value in event.items())
    return ("{" + body + "}").encode("utf-8", "surrogatepass")


@st.composite
def byte_mutated_events(draw) -> bytes:
    """A valid event's bytes with a random slice replaced by random bytes."""
    raw = json.dumps(draw(valid_events())).encode()
    start = draw(st.integers(0, len(raw)))
    end = draw(st.integers(start, min(len(raw), start + 8)))
    return raw[:start] + draw(st.binary(max_size=8)) + raw[end:]


record_values = st.one_of(st.binary(max_size=300), mutated_events(), byte_mutated_events(),
                          json_values.map(lambda v: json.dumps(v).encode()))
record_keys = st.none() | st.binary(max_size=20) | ids.map(str.encode)


def samples(strategy: st.SearchStrategy, n: int) -> list:
    """``n`` examples drawn by hypothesis, to send through a real service."""
    found = []

    @settings(max_examples=n, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(value) -> None:
        found.append(value)

    collect()
    return found
