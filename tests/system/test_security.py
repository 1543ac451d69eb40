"""Safe by default, on the real server at its defaults (no INFERSCALE_API_KEYS: its local admin
key only): the right key gets through and no other caller does; a page of another site, a
rebound DNS name and "simple" cross-site requests read and change nothing, in a real headless
browser too; a forget leaves other owners' prefix cache alone; control characters in ids are
client errors."""

import shutil
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import quote, urlsplit

import httpx
import pytest

from conftest import AUTH
from helpers import ines_with_two_facts
from inferscale.client import MemoryAPIError, MemoryClient

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
async def owner(served, smol, base_settings, engine, embedder):
    """An owner with two encoded facts."""
    return await ines_with_two_facts(served, smol, base_settings, engine, embedder, "secure")


def _memory_requests(url: str, user: str, fact_id: int) -> list[tuple[str, str, dict | None]]:
    """One request of each memory route and a memory chat (none changes anything)."""
    base = f"{url}/v1/memory/users/{user}"
    return [
        ("GET", f"{base}/facts", None),
        ("GET", f"{base}/facts/{fact_id}", None),
        ("GET", f"{base}/facts/{fact_id}/history", None),
        ("POST", f"{base}/search", {"query": "horse"}),
        ("PATCH", f"{base}/facts/{2**62}", {"text": "x"}),  # no such fact: 404 once admitted
        ("DELETE", f"{base}/facts/{2**62}", None),
        ("POST", f"{base}/turns", {"turns": [{"conversation_id": "c", "turn_id": "x",
                                                "speaker": "s", "text": ""}]}),  # refused turn
        ("POST", f"{url}/v1/chat/completions", {
            "model": "inferscale", "user": user, "max_tokens": 1,
            "messages": [{"role": "user", "content": "What is my horse called?"}]}),
    ]


def test_the_right_key_gets_through_and_no_other_caller_does(served, owner):
    fact_id = MemoryClient(served.url).list_facts(owner)["facts"][0]["id"]
    for method, url, body in _memory_requests(served.url, owner, fact_id):
        right = httpx.request(method, url, json=body, headers=AUTH, timeout=120)
        assert right.status_code in (200, 202, 404), (method, url, right.text)
        for wrong in ({}, {"authorization": "Bearer wrong"}, {"authorization": AUTH[
                "authorization"] + "x"}, {"authorization": AUTH["authorization"].lower()},
                {"authorization": "Basic " + AUTH["authorization"].split()[1]}):
            refused = httpx.request(method, url, json=body, headers=wrong, timeout=60)
            assert refused.status_code == 401, (method, url, wrong, refused.text)
            assert owner not in refused.text and "Biscuit" not in refused.text
    with pytest.raises(MemoryAPIError) as anonymous:
        MemoryClient(served.url, api_key="").list_facts(owner)
    assert anonymous.value.status == 401
    for path in ("/scale_elastic_ep", "/is_scaling_elastic_ep", "/invocations"):  # admin
        assert httpx.post(served.url + path, json={}, timeout=30).status_code == 401


def test_rebound_host_names_and_foreign_origins_are_refused(served, owner):
    port = urlsplit(served.url).port
    fact_id = MemoryClient(served.url).list_facts(owner)["facts"][0]["id"]
    for method, url, body in _memory_requests(served.url, owner, fact_id):
        for headers in ({"host": f"attacker.example:{port}"},  # DNS rebinding
                        {"host": f"127.0.0.1.attacker.example:{port}"},
                        {"origin": "https://attacker.example"},  # another site's page
                        {"origin": f"http://localhost:{port}"},  # another origin, even local
                        {"origin": "null"}, {"sec-fetch-site": "cross-site",
                                             "sec-fetch-mode": "no-cors"}):
            refused = httpx.request(method, url, json=body, headers={**AUTH, **headers},
                                    timeout=60)
            assert refused.status_code == 403, (method, url, headers, refused.text)
            assert "access-control-allow-origin" not in refused.headers
            assert "Biscuit" not in refused.text
    own_page = httpx.get(f"{served.url}/v1/memory/users/{owner}/facts", timeout=60, headers={
        **AUTH, "origin": served.url, "sec-fetch-site": "same-origin"})
    assert own_page.status_code == 200  # the server's own page is let through
    assert httpx.get(f"{served.url}/health", headers={"host": "10.9.8.7"}).status_code == 200


def test_simple_cross_site_requests_change_nothing(served, owner):
    before = MemoryClient(served.url).list_facts(owner)["facts"]
    forget = f"{served.url}/v1/memory/forget"
    for content_type in ("text/plain", "application/x-www-form-urlencoded",
                         "multipart/form-data; boundary=x", None):
        headers = {**AUTH, **({"content-type": content_type} if content_type else {})}
        for url, body in ((forget, f'{{"user": "{owner}"}}'),
                          (f"{served.url}/v1/memory/users/{owner}/turns", '{"turns": []}')):
            refused = httpx.post(url, content=body.encode(), headers=headers, timeout=60)
            assert refused.status_code == 415, (url, content_type, refused.text)
    assert MemoryClient(served.url).list_facts(owner)["facts"] == before


def test_inspector_page_runs_only_its_script_and_is_never_framed(served):
    page = httpx.get(f"{served.url}/memory", timeout=30)
    assert page.status_code == 200
    assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
    assert page.headers["x-frame-options"] == "DENY"


def _attack_page(target: str, owner: str) -> str:
    """A page of another site that tries to read, add and forget ``owner``'s memory on
    ``target``: a CORS read, a JSON add (preflighted), and "simple" no-cors forgets with
    text/plain and with a Blob that has no type. It reports what it could read."""
    return f"""<!doctype html><script>
const target = {target!r}, owner = {owner!r}, results = {{}};
async function attempt(name, work) {{
  try {{ const r = await work(); results[name] = r.type === "opaque" ? "opaque"
                                     : r.status + ":" + (await r.text()); }}
  catch (e) {{ results[name] = "error"; }}
}}
window.attack = (async () => {{
  await attempt("read", () => fetch(target + "/v1/memory/users/" + owner + "/facts"));
  await attempt("add", () => fetch(target + "/v1/memory/users/" + owner + "/turns", {{
    method: "POST", headers: {{"content-type": "application/json"}},
    body: JSON.stringify({{turns: [{{conversation_id: "c", turn_id: "evil", speaker: "x",
                                     text: "evil", timestamp: "2025-01-01T00:00:00Z"}}]}})}}));
  await attempt("forget-text", () => fetch(target + "/v1/memory/forget", {{
    method: "POST", mode: "no-cors", headers: {{"content-type": "text/plain"}},
    body: JSON.stringify({{user: owner}})}}));
  await attempt("forget-blob", () => fetch(target + "/v1/memory/forget", {{
    method: "POST", mode: "no-cors", body: new Blob([JSON.stringify({{user: owner}})])}}));
  await attempt("delete", () => fetch(target + "/v1/memory/users/" + owner, {{
    method: "DELETE"}}));
  await attempt("chat", () => fetch(target + "/v1/chat/completions", {{
    method: "POST", mode: "no-cors", headers: {{"content-type": "text/plain"}},
    body: JSON.stringify({{model: "inferscale", user: owner, max_tokens: 4,
                          messages: [{{role: "user", content: "What is my horse called?"}}]}})}}));
  return results;
}})();
</script>"""


class _Page(BaseHTTPRequestHandler):
    html = ""

    def do_GET(self):  # noqa: N802 - http.server's name
        body = self.html.encode()
        self.send_response(200)
        self.send_header("content-type", "text/html")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        pytest.skip("no Chromium from the system packages (.ci/install.sh installs it)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        # attacker.test resolves to this machine, as a rebinding name does once re-pointed
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--host-resolver-rules=MAP attacker.test 127.0.0.1"])
        yield chromium
        chromium.close()


def _run_attack(browser, page_url: str, target: str, owner: str) -> dict:
    _Page.html = _attack_page(target, owner)
    page = browser.new_page()
    try:
        page.goto(page_url)
        return page.evaluate("window.attack")
    finally:
        page.close()


def test_a_page_of_another_site_in_a_real_browser_reads_and_changes_nothing(
        served, owner, browser):
    memory = MemoryClient(served.url)
    before = memory.list_facts(owner)["facts"]
    site = ThreadingHTTPServer(("127.0.0.1", 0), _Page)
    threading.Thread(target=site.serve_forever, daemon=True).start()
    try:
        # A cross-site page (another port of this machine: another origin) aims at the server.
        results = _run_attack(browser, f"http://127.0.0.1:{site.server_port}/", served.url,
                              owner)
        assert results["read"] == "error" and results["add"] == "error"  # CORS: unreadable
        assert results["delete"] == "error"
        assert results["forget-text"] == results["forget-blob"] == "opaque"  # sent, refused
        # A rebinding page: its own name, on the server's port, same-origin to the browser.
        port = urlsplit(served.url).port
        rebound = f"http://attacker.test:{port}"
        results = _run_attack(browser, f"http://attacker.test:{site.server_port}/",
                              rebound, owner)
        assert all(not r.startswith("200") and "Biscuit" not in r for r in results.values()), (
            results)
    finally:
        site.shutdown()
    assert memory.list_facts(owner)["facts"] == before  # nothing forgotten
    assert not any(f["turn_ids"] == ["evil"] for f in memory.list_facts(owner)["facts"])


def test_the_browser_rebinding_page_on_the_servers_own_port_is_refused(served, owner,
                                                                       browser):
    """The page itself comes from the server's port under the attacker's name: the server
    refuses it, so it can neither load nor call anything there."""
    port = urlsplit(served.url).port
    page = browser.new_page()
    try:
        response = page.goto(f"http://attacker.test:{port}/memory")
        assert response is not None and response.status == 403
        read = page.evaluate(f"""fetch("/v1/memory/users/{owner}/facts")
            .then(r => r.status + ":" + r.headers.get("content-type"))""")
        assert read.startswith("403:")
    finally:
        page.close()


def test_a_forget_leaves_other_owners_prefix_cache_alone(served, owner):
    question = "Where does Ines teach?"
    messages = [{"role": "system", "content": "Answer briefly. " * 150},  # > 2 cache blocks
                {"role": "user", "content": question}]
    served.chat(owner, question, mode="text", k=2, messages=messages)
    warm = served.chat(owner, question, mode="text", k=2, messages=messages)
    assert warm.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    other = f"forgotten-{uuid.uuid4().hex[:6]}"
    MemoryClient(served.url).add_fact(other, "Gus keeps bees on the roof in Ghent.")
    assert MemoryClient(served.url).forget(other)["facts_deleted"] == 1
    after = served.chat(owner, question, mode="text", k=2, messages=messages)
    assert after.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= warm.json()[
        "usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("bad", ["a\0b", "tab\tuser", "line\nbreak", "bell\x07", "del\x7f",
                                 "esc\x1b[31m"])
def test_control_characters_in_ids_are_client_errors_everywhere(served, bad):
    encoded = quote(bad, safe="")
    base = f"{served.url}/v1/memory/users/{encoded}"
    for method, url, body in _memory_requests(served.url, bad, 1)[:-1]:
        url = url.replace(f"/users/{bad}", f"/users/{encoded}")
        response = httpx.request(method, url, json=body, headers=AUTH, timeout=60)
        assert response.status_code == 400, (method, url, response.text)
    assert httpx.delete(base, headers=AUTH, timeout=60).status_code == 400
    forget = httpx.post(f"{served.url}/v1/memory/forget", json={"user": bad}, headers=AUTH,
                        timeout=60)
    assert forget.status_code == 400  # vLLM answers a schema refusal 400
    for chat in (served.chat(bad, "hi"), served.chat(None, "hi", headers={
            "x-inferscale-user": bad.replace("\n", "\t")}) if "\n" in bad else
            served.chat("ok", "hi", inferscale={"agent_id": bad})):
        assert chat.status_code == 400, chat.text
