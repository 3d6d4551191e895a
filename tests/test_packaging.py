"""What a fresh virtualenv gets from `pip install -e ".[test]"` (the README's first command, .ci/run): every
third-party module the tests import, themselves or through the package, is a dependency of the package or its
`test` extra, or one of theirs."""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[(]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def installed_with_test_extra() -> set[str]:
    """Distribution names the editable install with [test] brings: the listed ones and, through the installed
    metadata, what they require (extras of theirs left out)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    todo = [_name(r) for r in project["dependencies"] + project["optional-dependencies"]["test"]]
    seen: set[str] = set()
    while todo:
        dist = todo.pop()
        if dist in seen:
            continue
        seen.add(dist)
        try:
            reqs = md.requires(dist) or []
        except md.PackageNotFoundError:
            continue
        todo += [_name(r) for r in reqs if "extra ==" not in r]
    return seen


def _guarded(tree: ast.AST) -> set[int]:
    """ids of the import nodes inside a `try` that handles ImportError (optional: the code runs without them)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(
                isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError")
                for h in node.handlers):
            out.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return out


def imported_by_tests() -> set[str]:
    """Third-party top-level modules that the tests import, directly or through the package (the kernels import
    triton), leaving out optional imports guarded by `except ImportError`."""
    local = {p.stem for p in (ROOT / "tests").glob("*.py")} | {"megadecode"}
    mods = set()
    for f in [*(ROOT / "tests").glob("*.py"), *(ROOT / "megadecode").rglob("*.py")]:
        tree = ast.parse(f.read_text())
        optional = _guarded(tree)
        for node in ast.walk(tree):
            if id(node) in optional:
                continue
            if isinstance(node, ast.Import):
                mods.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and not node.level:
                mods.add(node.module.split(".")[0])
    return {m for m in mods if m not in sys.stdlib_module_names and m not in local}


def test_the_test_extra_brings_every_module_the_tests_import():
    dists = installed_with_test_extra()
    providers = md.packages_distributions()
    missing = {m: providers.get(m) for m in imported_by_tests()
               if not {d.lower().replace("_", "-") for d in providers.get(m, [m])} & dists}
    assert missing == {}, f"imported by the tests, not installed by pip install -e '.[test]': {missing}"
    assert {"triton", "torch", "transformers"} <= imported_by_tests()  # the scan sees through the package


def test_ci_installs_into_a_fresh_virtualenv_and_runs_the_readme_command():
    ci = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    assert "-m venv" in ci and '"$py" -m pip install -q torch==2.13.0' in ci
    assert '"$py" -m pip install -q -e ".[test]"' in ci and '"$py" -m pytest -q' in ci
    assert 'pip install torch==2.13.0 && pip install -e ".[test]"' in readme and "python -m pytest -q\n" in readme
