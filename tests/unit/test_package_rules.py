"""The house rules the layout promises: the product never imports the lab, nor the dev stack
(the CLI's dev commands aside: they start it), the KV path never reaches up into serving, only
the maintenance stage maintains the durable tier, blobs are named in one module, the lab's tests
live in tests/lab, and no two modules share a name."""

import ast
import re
from collections import Counter
from importlib.metadata import requires
from pathlib import Path

import inferscale
from inferscale import workers

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


# The CLI commands that start or run the embedded dev stack: `infra up | down | status`, `demo`.
DEV_COMMANDS = {"inferscale/cli/ops_commands.py", "inferscale/cli/run_commands.py"}


def _offenders(files, prefix: str) -> dict[str, list[str]]:
    found = {str(p.relative_to(PACKAGE.parent)): sorted(
        n for n in _imported(p) if n == prefix or n.startswith(prefix + "."))
        for p in files}
    return {path: names for path, names in found.items() if names}


def test_the_product_never_imports_the_dev_stack():
    """Product code finds its broker and database through ``core/endpoints.py``."""
    product = [p for p in PRODUCT if PACKAGE / "devstack" not in p.parents
               and str(p.relative_to(PACKAGE.parent)) not in DEV_COMMANDS]
    assert _offenders(product, "inferscale.devstack") == {}


def test_the_kv_path_never_reaches_up_into_serving():
    assert _offenders(list((PACKAGE / "kv").rglob("*.py")), "inferscale.serving") == {}


LAB_AND_TEST_ONLY = ("matplotlib", "nltk", "yaml", "pytest", "hypothesis", "playwright", "moto")


def test_the_product_imports_no_lab_or_test_dependency():
    for name in LAB_AND_TEST_ONLY:
        assert _offenders(PRODUCT, name) == {}, name


def test_the_package_installs_without_lab_or_test_dependencies():
    """What ``pip install inferscale`` pulls (the installed metadata): the lab's and the
    tests' packages only under their extras."""
    core = [r for r in requires("inferscale") or [] if "extra ==" not in r]
    names = {re.split(r"[<>=!~ ;\[]", r, maxsplit=1)[0].lower() for r in core}
    assert names and not names & {"matplotlib", "nltk", "pyyaml", "pytest", "hypothesis",
                                  "playwright", "moto"}


ROOT = PACKAGE.parent
SHIPPED_FROM = {"workers": "inferscale.workers", "migrations": "inferscale.migrations"}


def test_the_wheel_ships_every_product_package_and_not_the_lab():
    """pyproject's package list is every package folder of the product, ``workers/`` and
    ``migrations/`` under the inferscale namespace, and not the lab."""
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = set()
    for top in ("inferscale", *SHIPPED_FROM):
        for init in (ROOT / top).rglob("__init__.py"):
            if PACKAGE / "lab" in init.parents or init.parent == PACKAGE / "lab":
                continue
            parts = init.parent.relative_to(ROOT).parts
            folders.add(".".join((SHIPPED_FROM.get(parts[0], parts[0]), *parts[1:])))
    assert set(config["packages"]) == folders
    assert config["package-dir"] == {name: folder for folder, name in SHIPPED_FROM.items()}


def test_workers_and_migrations_are_imported_by_their_shipped_names():
    """``import workers`` works from the repository's root only: everything names them as the
    wheel ships them (``inferscale.workers``, ``inferscale.migrations``)."""
    files = [p for top in ("inferscale", "workers", "migrations", "tests")
             for p in (ROOT / top).rglob("*.py")]
    offenders = {str(p.relative_to(ROOT)): sorted(
        n for n in _imported(p) if n.split(".")[0] in SHIPPED_FROM) for p in files}
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


def test_no_package_is_named_after_a_stdlib_module():
    """A folder named like a stdlib module (``platform``, ``logging``) shadows it for anyone who
    runs a module from inside the package's folder, and misleads readers."""
    import sys

    folders = {p.parent.name for p in PRODUCT if p.name == "__init__.py"}
    assert sorted(folders & sys.stdlib_module_names) == []


# The durable tier's upkeep: eviction under the KV budgets, model migration, the orphan sweep
# (``workers/maintenance.py`` holds the sweep itself).
MAINTENANCE = ("inferscale.db.kv_budget.evict_over_budget",
               "inferscale.db.encode_queue.drop_other_models", "inferscale.db.deletion.blobs_owned")


def test_only_the_maintenance_stage_maintains_the_durable_tier():
    users = {str(p.relative_to(PACKAGE.parent)) for p in PRODUCT
             if _imported(p) & set(MAINTENANCE)}
    assert users == {"workers/maintenance.py"}


def test_blobs_are_named_in_one_module():
    """``contracts/blob_name.py`` spells blob names (``preamble``, ``<id>.lead``); everything
    else, the lab included, names blobs through it."""
    files = [p for root in (PACKAGE, Path(workers.__file__).parent) for p in root.rglob("*.py")]
    spelled = {str(p.relative_to(PACKAGE.parent)) for p in files
               for node in ast.walk(ast.parse(p.read_text(), str(p)))
               if isinstance(node, ast.Constant) and isinstance(node.value, str)
               and (node.value == "preamble" or ".lead" in node.value)}
    assert spelled == {"inferscale/contracts/blob_name.py"}


# What the product's tests may borrow from the lab: the stand-in for vLLM's cache update that
# the portable chain and the fused writers are checked against.
LAB_HELPERS = {"inferscale.lab.bench.inject", "inferscale.lab.bench.inject.flash_update"}


def test_the_labs_tests_live_in_tests_lab():
    tests = Path(__file__).parents[1]
    product_tests = [p for p in tests.rglob("*.py") if tests / "lab" not in p.parents]
    borrowed = {str(p.relative_to(tests)): sorted(
        n for n in _imported(p) if n.startswith("inferscale.lab") and n not in LAB_HELPERS)
        for p in product_tests}
    assert {path: names for path, names in borrowed.items() if names} == {}
