"""The documentation holds together: the configuration page is what the settings generate (every
setting described), every relative link resolves, every page is reachable from the README, every
results file is cited, and the README stays a page for users."""

from __future__ import annotations

import re
from pathlib import Path

from inferscale.core.settings_doc import configuration_markdown

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
RESULTS = DOCS / "results"
README_MAX_LINES = 200
README_MAX_COLUMNS = 120

FENCED = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # http:, https:, mailto:, ...


def pages() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def relative_links(page: Path) -> list[tuple[str, Path]]:
    """(link as written, file it points to) for every relative link of a markdown page; links
    inside code are not links."""
    text = INLINE_CODE.sub("", FENCED.sub("", page.read_text(encoding="utf-8")))
    links = []
    for target in LINK.findall(text):
        if EXTERNAL.match(target) or target.startswith("#"):
            continue
        path = target.split("#", 1)[0]
        links.append((target, (page.parent / path).resolve()))
    return links


def test_configuration_page_is_generated_from_the_settings():
    page = (DOCS / "configuration.md").read_text(encoding="utf-8")
    assert page == configuration_markdown(), (
        "docs/configuration.md is out of date with inferscale/core/settings.py: run "
        "`python -m inferscale.core.settings_doc`")


def test_the_api_reference_is_generated_from_the_openapi_document():
    from inferscale.serving.api_doc import api_markdown, openapi

    page = (DOCS / "api-reference.md").read_text(encoding="utf-8")
    assert page == api_markdown(), (
        "docs/api-reference.md is out of date with the memory routes: run "
        "`python -m inferscale.serving.api_doc`")
    for path, methods in openapi()["paths"].items():  # every route is on the page
        for method in methods:
            assert f"### `{method.upper()} {path}`" in page


def test_every_setting_is_described_and_the_page_opens_with_a_section():
    """The page is generated from ``Field(description=...)``: no setting without one, and the
    sections name fields (the first field opens the first one)."""
    from inferscale.core.settings import Settings

    fields = Settings.model_fields
    assert [name for name, field in fields.items() if not field.description] == []
    assert set(Settings.SECTIONS) <= set(fields) and next(iter(fields)) in Settings.SECTIONS


def test_every_relative_link_points_to_a_file():
    broken = [f"{page.relative_to(ROOT)}: {target}"
              for page in pages() for target, path in relative_links(page) if not path.exists()]
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_every_page_is_reachable_from_the_readme():
    direct = {path for _, path in relative_links(README) if path.suffix == ".md"}
    reachable = set(direct)
    for page in direct:
        if page.exists():
            reachable |= {path for _, path in relative_links(page) if path.suffix == ".md"}
    wanted = sorted(DOCS.glob("*.md")) + sorted(RESULTS.glob("*.md"))
    missing = [str(p.relative_to(ROOT)) for p in wanted if p.resolve() not in reachable]
    assert not missing, ("pages not linked from README.md (nor from a page it links): "
                         + ", ".join(missing))


def test_every_results_file_is_cited_by_a_page():
    cited = {path for page in pages() for _, path in relative_links(page)}
    uncited = [str(p.relative_to(ROOT)) for p in sorted(RESULTS.iterdir())
               if p.is_file() and p.resolve() not in cited]
    assert not uncited, ("files in docs/results/ that no page links to (cite them or delete "
                         "them): " + ", ".join(uncited))


def test_readme_is_short():
    lines = len(README.read_text(encoding="utf-8").splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines (at most {README_MAX_LINES}): move detail into docs/")
    wide = [n for n, line in enumerate(README.read_text(encoding="utf-8").splitlines(), 1)
            if len(line) > README_MAX_COLUMNS]
    assert not wide, f"README.md lines over {README_MAX_COLUMNS} characters: {wide}"
