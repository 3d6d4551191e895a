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

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[(]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def listed_for_test() -> list[str]:
    """The distributions pyproject lists for `pip install -e '.[test]'` (the dependencies and the test extra)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [_name(r) for r in project["dependencies"] + project["optional-dependencies"]["test"]]


def installed_with_test_extra() -> set[str]:
    """Distribution names the editable install with [test] brings: the listed ones and, through the installed
    metadata, what they require (extras of theirs left out)."""
    todo = listed_for_test()
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


def _installed(dist: str) -> bool:
    try:
        md.distribution(dist)
    except md.PackageNotFoundError:
        return False
    return True


def _optional(node: ast.Try) -> bool:
    return any(isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError")
               for h in node.handlers)


def _imports(tree: ast.Module, everywhere: bool):
    """Import statements (and `pytest.importorskip("x")`, as `import x`) that run: at module level (not in a
    function), or anywhere with `everywhere` (a test module's functions run too); never inside a `try` that
    handles ImportError (an optional dependency: the code runs without it)."""
    def visit(node):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and not everywhere:
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "importorskip"
              and node.args and isinstance(node.args[0], ast.Constant)):
            yield ast.Import(names=[ast.alias(name=node.args[0].value)])
        children = (node.handlers + node.orelse + node.finalbody if isinstance(node, ast.Try) and _optional(node)
                    else ast.iter_child_nodes(node))
        for child in children:
            yield from visit(child)
    yield from visit(tree)


def _source(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    for f in (base.with_suffix(".py"), base / "__init__.py"):
        if f.is_file():
            return f
    return None


def imported_by_tests() -> set[str]:
    """Third-party top-level modules the tests import: theirs (anywhere in a test module), and those the package
    modules they import import at module level, followed through the package (the kernels import triton). The
    package's imports inside functions are left out (e.g. the CuTe DSL of GPU-only paths, the `cute` extra)."""
    local = {p.stem for d in ("tests", "bench") for p in (ROOT / d).glob("*.py")}  # tests import a few bench scripts
    todo = [(f, None) for f in (ROOT / "tests").glob("*.py")]
    seen, third = set(), set()
    while todo:
        f, package = todo.pop()
        if f in seen:
            continue
        seen.add(f)
        for node in _imports(ast.parse(f.read_text()), everywhere=package is None):
            if isinstance(node, ast.ImportFrom) and node.level:  # relative: inside the package
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                names = [".".join(parts + ([node.module] if node.module else []))]
                names += [f"{names[0]}.{a.name}" for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                names = [a.name for a in node.names]
            for name in names:
                top = name.split(".")[0]
                if top != "megadecode":
                    if top not in sys.stdlib_module_names and top not in local and top != "__future__":
                        third.add(top)
                    continue
                parts = name.split(".")
                for i in range(1, len(parts) + 1):  # importing a.b.c runs a, a.b and a.b.c
                    src = _source(".".join(parts[:i]))
                    if src is not None:
                        pkg = ".".join(parts[:i]) if src.name == "__init__.py" else ".".join(parts[:i - 1])
                        todo.append((src, pkg))
    return third


# modules a distribution puts on sys.path through a .pth file (packages_distributions() cannot see them)
PTH_PROVIDERS = {"cutlass": ["nvidia-cutlass-dsl"]}


def test_the_test_extra_brings_every_module_the_tests_import():
    absent = [d for d in listed_for_test() if not _installed(d)]
    if absent:  # e.g. the GPU machine, which runs the suite from a copy without the serve stack
        pytest.skip(f"this environment was not installed with '.[test]' (missing {', '.join(absent)}): the "
                    "requirements of what is absent cannot be walked")
    dists = installed_with_test_extra()
    providers = {**md.packages_distributions(), **PTH_PROVIDERS}
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
