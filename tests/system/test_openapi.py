"""Property-based tests of the memory API driven by its own OpenAPI document (Schemathesis, on
the real server): for requests generated from every memory route's schema (the native routes
and Mem0's), the server never answers 5xx, answers only the status codes and content types the
document declares, and every answer matches its declared response model. Run with an admin key
(who may call what is ``test_security.py``'s); Hypothesis keeps the examples per route small."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
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


@pytest.fixture(scope="module")
def memory_api(served):
    schema = schemathesis.openapi.from_url(f"{served.url}/openapi.json", headers=AUTH,
                                           timeout=60)
    return schema.include(path_regex=r"^/(v1/memory/|v1/memories|v3/memories|v1/batch|v1/ping|"
                                     r"v2/entities|v1/entities)")


api = schemathesis.pytest.from_fixture("memory_api")


@api.parametrize()
@settings(max_examples=15, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_memory_routes_keep_their_openapi_contract(case):
    case.call_and_validate(headers=AUTH, checks=CHECKS, timeout=120)
