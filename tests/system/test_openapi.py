"""Property-based tests of the memory API driven by its own OpenAPI document (Schemathesis, on
the real server): for requests generated from every memory route's schema (the native routes
and Mem0's), the server never answers 5xx, answers only the status codes and content types the
document declares, and every answer matches its declared response model. Run with an admin key
(who may call what is ``test_security.py``'s); Hypothesis keeps the examples per route small.

Schemathesis's pytest plugin does not run under this pytest (9), so each operation's strategy
drives a Hypothesis test here; a failure names the operation and the case to reproduce it."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from conftest import AUTH

pytestmark = pytest.mark.slow
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]
MEMORY_ROUTES = (r"^/(v1/memory/|v1/memories|v3/memories|v1/batch|v1/ping|v2/entities|"
                 r"v1/entities)")


def test_memory_routes_keep_their_openapi_contract(served):
    schema = schemathesis.openapi.from_url(f"{served.url}/openapi.json", headers=AUTH,
                                           timeout=60).include(path_regex=MEMORY_ROUTES)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 25  # every memory route is in the document
    statuses: list[int] = []
    for operation in operations:
        @given(case=operation.as_strategy())
        @settings(max_examples=15, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def keeps_its_contract(case) -> None:
            response = case.call_and_validate(base_url=served.url, headers=AUTH,
                                              checks=CHECKS, timeout=120)
            statuses.append(response.status_code)

        try:
            keeps_its_contract()
        except Exception as exc:
            raise AssertionError(f"{operation.method.upper()} {operation.path}: {exc}") from exc
    # The requests went through: many, and both answers and refusals among them.
    assert len(statuses) >= 10 * len(operations), len(statuses)
    assert any(s < 300 for s in statuses) and any(400 <= s < 500 for s in statuses)
