"""From where a request may come (``serving/browser_guard.py``, pure logic): DNS rebinding,
cross-site pages and "simple" requests refused on every route; the server's own page, other
clients and configured names and origins let through."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from inferscale.core.settings import Settings
from inferscale.serving.browser_guard import check_request, host_name, page_headers
from inferscale.serving.guards import FrontendError

DEFAULT = Settings()
JSON = {"content-type": "application/json", "content-length": "2"}


def _status(settings: Settings, method: str, path: str, headers: dict[str, str]) -> int:
    try:
        check_request(settings, method, path, headers)
    except FrontendError as exc:
        return exc.status
    return 200


@pytest.mark.parametrize(("host", "status"), [
    ("127.0.0.1:8000", 200), ("localhost:8000", 200), ("LOCALHOST", 200), ("[::1]:8000", 200),
    ("127.3.4.5", 200), ("localhost.", 200),
    ("attacker.example:8000", 403),  # a rebound name: same-origin to the browser, not to us
    ("127.0.0.1.attacker.example", 403), ("localhost.attacker.example", 403),
    ("10.0.0.5:8000", 403), ("", 403), ("a b", 403), ("[::1", 403), ("host:port", 403),
])
def test_only_names_the_server_answers_to(host, status):
    for path in ("/v1/memory/users/u/facts", "/v1/chat/completions", "/memory", "/metrics"):
        assert _status(DEFAULT, "GET", path, {"host": host}) == status


def test_configured_names_and_the_listening_address():
    settings = Settings(allowed_hosts=["memory.example.com"], server_host="10.0.0.5")
    for host in ("memory.example.com", "MEMORY.example.com:443", "10.0.0.5:8000"):
        assert _status(settings, "GET", "/v1/memory/users/u/facts", {"host": host}) == 200
    assert _status(settings, "GET", "/v1/memory/users/u/facts", {"host": "evil.com"}) == 403
    wildcard = Settings(server_host="0.0.0.0")  # listening everywhere names no host
    assert _status(wildcard, "GET", "/v1/models", {"host": "0.0.0.0:8000"}) == 403
    assert _status(Settings(allowed_hosts=["*"]), "GET", "/v1/models", {"host": "x"}) == 200


def test_health_probes_answer_any_host():
    for path in ("/health", "/ping"):
        assert _status(DEFAULT, "GET", path, {"host": "10.1.2.3:8000"}) == 200
    assert _status(DEFAULT, "POST", "/ping", {"host": "10.1.2.3:8000"}) == 403


@pytest.mark.parametrize(("origin", "status"), [
    ("http://127.0.0.1:8000", 200),  # the server's own page
    ("http://localhost:8000", 403),  # another origin, though a loopback one
    ("http://127.0.0.1:3000", 403),
    ("https://attacker.example", 403),
    ("null", 403),  # sandboxed frames, file: pages
    ("javascript://127.0.0.1:8000", 403),
    ("not a url", 403),
])
def test_foreign_origins_are_refused_on_every_route(origin, status):
    headers = {"host": "127.0.0.1:8000", "origin": origin, **JSON}
    for method, path in (("POST", "/v1/memory/forget"), ("GET", "/v1/memory/users/u/facts"),
                         ("DELETE", "/v1/memory/users/u"), ("POST", "/v1/chat/completions"),
                         ("POST", "/v1/completions"), ("OPTIONS", "/v1/memory/users/u")):
        assert _status(DEFAULT, method, path, headers) == status, (method, path)


def test_listed_origins_are_let_through():
    settings = Settings(allowed_origins=["http://localhost:3000"])
    headers = {"host": "127.0.0.1:8000", "origin": "http://localhost:3000", **JSON}
    assert _status(settings, "POST", "/v1/memory/users/u/search", headers) == 200
    headers["origin"] = "http://localhost:3001"
    assert _status(settings, "POST", "/v1/memory/users/u/search", headers) == 403


def test_cross_site_requests_without_origin_are_refused_but_navigation_is_not():
    base = {"host": "127.0.0.1:8000"}
    for site in ("cross-site", "same-site"):
        fetch = {**base, "sec-fetch-site": site, "sec-fetch-mode": "no-cors"}
        assert _status(DEFAULT, "GET", "/v1/memory/users/u/facts", fetch) == 403
        navigate = {**base, "sec-fetch-site": site, "sec-fetch-mode": "navigate"}
        assert _status(DEFAULT, "GET", "/memory", navigate) == 200
    same = {**base, "sec-fetch-site": "same-origin", "sec-fetch-mode": "cors"}
    assert _status(DEFAULT, "GET", "/v1/memory/users/u/facts", same) == 200


@pytest.mark.parametrize(("content_type", "status"), [
    ("application/json", 200), ("application/json; charset=utf-8", 200),
    ("Application/JSON", 200),
    ("text/plain", 415), ("text/plain; charset=utf-8", 415),  # a "simple" request
    ("application/x-www-form-urlencoded", 415), ("multipart/form-data; boundary=x", 415),
    (None, 415),  # a no-cors fetch of a Blob sends no content type
    ("application/jsonp", 415),
])
def test_memory_and_chat_bodies_must_be_json(content_type, status):
    headers = {"host": "127.0.0.1:8000", "content-length": "20"}
    if content_type is not None:
        headers["content-type"] = content_type
    for method, path in (("POST", "/v1/memory/forget"), ("PATCH", "/v1/memory/users/u/facts/1"),
                         ("POST", "/v1/memory/users/u/turns"), ("POST", "/v1/chat/completions"),
                         ("POST", "/v1/responses")):
        assert _status(DEFAULT, method, path, headers) == status, (method, path)
    # vLLM's other routes keep their own types (an audio upload is multipart)
    assert _status(DEFAULT, "POST", "/v1/audio/transcriptions", headers) == 200
    # a request with no body is not a body of the wrong type
    assert _status(DEFAULT, "DELETE", "/v1/memory/users/u", {"host": "127.0.0.1"}) == 200


@given(st.text(max_size=80))
def test_any_host_header_is_answered_without_error(header):
    name = host_name(header)
    assert name is None or name == name.lower()
    assert _status(DEFAULT, "GET", "/v1/models", {"host": header}) in (200, 403)


@given(st.text(max_size=80))
def test_any_origin_header_is_answered_without_error(origin):
    status = _status(DEFAULT, "POST", "/v1/memory/forget",
                     {"host": "127.0.0.1:8000", "origin": origin, **JSON})
    assert status == (200 if origin == "http://127.0.0.1:8000" else 403)


def test_the_page_runs_its_own_script_only_and_is_never_framed():
    headers = page_headers("console.log(1)")
    policy = headers["content-security-policy"]
    assert "script-src 'sha256-" in policy and "'unsafe-inline'" not in policy.split(
        "script-src")[1].split(";")[0]
    assert "frame-ancestors 'none'" in policy and "connect-src 'self'" in policy
    assert headers["x-frame-options"] == "DENY"
    assert page_headers("other")["content-security-policy"] != policy


# The routes this round of the memory API added: an add's event, export, import, a fact with an
# expiry; and Mem0's add, which now also carries metadata and an expiry.
NEW_ROUTES = [("GET", "/v1/memory/users/u/events/0123456789abcdef0123456789abcdef", False),
              ("GET", "/v1/memory/users/u/export", False),
              ("POST", "/v1/memory/users/u/import", True),
              ("POST", "/v1/memory/users/u/facts", True),
              ("POST", "/v3/memories/add/", True)]


@pytest.mark.parametrize(("method", "path", "body"), NEW_ROUTES)
def test_the_new_memory_routes_keep_the_browser_rules(method, path, body):
    own = {"host": "127.0.0.1:8000", **(JSON if body else {})}
    assert _status(DEFAULT, method, path, own) == 200
    assert _status(DEFAULT, method, path, {**own, "host": "attacker.example"}) == 403
    assert _status(DEFAULT, method, path, {**own, "origin": "https://attacker.example"}) == 403
    assert _status(DEFAULT, method, path, {**own, "sec-fetch-site": "cross-site"}) == 403
    if body:  # a "simple" cross-site form post cannot reach a change of memory
        assert _status(DEFAULT, method, path, {**own, "content-type": "text/plain"}) == 415
