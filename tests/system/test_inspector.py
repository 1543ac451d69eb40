"""The memory inspector page (``GET /memory``) in a real headless browser (the system's
Chromium, driven by Playwright) against the real server: an owner's facts with their KV status,
search, a question answered with the memory injected and prefilled side by side, an edit made
in the page that changes what the next answer is made of, and the fact's history."""

import shutil
import uuid

import pytest

from conftest import SUITE_KEY
from inferscale.client import MemoryClient

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    CHROMIUM is None, reason="no Chromium from the system packages (.ci/install.sh installs it "
                             "where it runs as root with apt)")]


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield chromium
        chromium.close()


def test_the_inspector_shows_searches_asks_and_edits_memory(served, browser):
    user = f"inspector-{uuid.uuid4().hex[:6]}"
    memory = MemoryClient(served.url)
    horse = memory.add_fact(user, "Ines's horse is called Biscuit and she is twelve.")
    school = memory.add_fact(user, "Ines teaches chemistry at a school in Porto.")
    page = browser.new_page()
    page.goto(f"{served.url}/memory#key={SUITE_KEY}")  # the link `inferscale serve` prints
    page.fill("#user", user)
    page.click("#load")
    rows = page.locator("#facts tbody tr")
    rows.nth(1).wait_for()
    assert [rows.nth(i).get_attribute("data-id") for i in range(2)] == [
        str(horse["id"]), str(school["id"])]
    assert "served as text" in rows.nth(0).locator(".kv").inner_text()  # no KV yet

    page.fill("#query", "What is the name of Ines's horse?")
    page.click("#search")
    page.locator("#hits li").first.wait_for()
    assert f"{horse['id']}: " in page.locator("#hits li").first.inner_text()

    def ask() -> tuple[str, str, str]:
        page.fill("#question", "What is the name of Ines's horse?")
        page.evaluate("document.querySelectorAll('.answers .meta').forEach(e => e.textContent='')")
        page.click("#ask")
        # locator waits: the page's CSP allows no eval, which wait_for_function needs
        page.locator("#text .meta", has_text="facts used").wait_for()
        inject = page.locator("#inject")
        return (inject.locator(".answer").inner_text(), inject.get_attribute("data-fact-ids"),
                page.locator("#text").get_attribute("data-fact-ids"))

    before, used_inject, used_text = ask()
    assert str(horse["id"]) in used_inject.split(",") and used_inject == used_text
    assert "TTFT" in page.locator("#inject .meta").inner_text()

    page.once("dialog", lambda dialog: dialog.accept("Ines's horse is called Pickles and she "
                                                     "is twelve."))
    rows.nth(0).locator("button.edit").click()
    page.locator("#status", has_text="replaced").wait_for()
    new_id = memory.history(user, horse["id"])[-1]["id"]
    assert new_id != horse["id"]
    page.locator(f"#facts tbody tr[data-id='{new_id}']").wait_for()
    after, used_after, _ = ask()
    assert str(new_id) in used_after.split(",") and str(horse["id"]) not in used_after.split(",")
    assert after != before  # the answer is made of the new version

    page.locator(f"#facts tbody tr[data-id='{new_id}'] button.history").click()
    page.locator("#history li").nth(1).wait_for()
    versions = page.locator("#history li").all_inner_texts()
    assert versions[0].startswith(f"{horse['id']}: ") and "replaced by" in versions[0]
    assert versions[1].startswith(f"{new_id}: ") and "(live)" in versions[1]
    assert page.locator("#status").inner_text() == ""  # nothing went wrong on the way
