"""The house rules the layout promises: the product never imports the lab, and no two modules
share a name."""

import ast
from collections import Counter
from pathlib import Path

import inferscale
import workers

PACKAGE = Path(inferscale.__file__).parent
PRODUCT = [p for root in (PACKAGE, Path(workers.__file__).parent) for p in root.rglob("*.py")
           if PACKAGE / "lab" not in p.parents]


def _imported(path: Path) -> set[str]:
    """Every module an ``import`` or ``from ... import`` in the file names (relative ones as
    written)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def test_the_product_never_imports_the_lab():
    offenders = {str(p.relative_to(PACKAGE.parent)): sorted(
        n for n in _imported(p) if n == "inferscale.lab" or n.startswith("inferscale.lab."))
        for p in PRODUCT}
    assert {path: names for path, names in offenders.items() if names} == {}


def test_the_lab_joins_the_cli_as_a_plugin():
    from inferscale.cli import build_parser

    parser = build_parser()
    for argv in (["bench", "ttft"], ["eval", "fidelity", "--data", "x.json"],
                 ["calibrate", "--data", "x.json"], ["serve"]):
        assert parser.parse_args(argv).command == argv[0]


def test_no_two_modules_share_a_name():
    modules = [p for root in (PACKAGE, Path(workers.__file__).parent) for p in root.rglob("*.py")
               if p.name not in ("__init__.py", "__main__.py")]
    shared = {name: n for name, n in Counter(p.stem for p in modules).items() if n > 1}
    assert shared == {}
