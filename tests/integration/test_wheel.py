"""What ``pip install inferscale`` gets (the wheel, built from a copy of the tree): the product
with its workers and migrations inside the ``inferscale`` package, no top-level ``workers`` or
``migrations``, not the lab, and the lab's and tests' dependencies only under their extras."""

from __future__ import annotations

import re
import shutil
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

from helpers import build_wheel

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("wheel")
    source = root / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for name in ("inferscale", "workers", "migrations"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns(
            "__pycache__", "*.so", "build", "*.egg-info"))
    return build_wheel(source, root / "dist")


def test_the_wheel_holds_the_product_and_not_the_lab(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (meta,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = Parser().parsestr(archive.read(meta).decode())
    assert {"inferscale/workers/encode.py", "inferscale/workers/run.py",
            "inferscale/migrations/env.py", "inferscale/migrations/script.py.mako",
            "inferscale/serving/connector.py", "inferscale/cli/__init__.py"} <= set(names)
    versions = [n for n in names if n.startswith("inferscale/migrations/versions/0")]
    assert len(versions) == len(list((ROOT / "migrations" / "versions").glob("0*.py")))
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"inferscale"}, tops
    assert not [n for n in names if n.startswith("inferscale/lab/")]
    core = [r for r in metadata.get_all("Requires-Dist") or [] if "extra ==" not in r]
    names_required = {re.split(r"[<>=!~ ;\[]", r, maxsplit=1)[0].lower() for r in core}
    assert names_required and not names_required & {
        "matplotlib", "nltk", "pyyaml", "pytest", "hypothesis", "playwright", "moto"}
