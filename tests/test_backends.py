"""The backends' boundaries (megadecode/backends/): the engine talks to executors through one protocol
(backends/base.py), a backend reaches into another only through the modules it builds on, and the family registry
(config/registry.py) is the only list of model families."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from megadecode.backends import EXECUTORS
from megadecode.backends.base import Executor, ExecutorBase
from megadecode.config import FAMILIES, REGISTRY
from megadecode.config.registry import EXECUTOR_NAMES, executor_refusal, families_for
from megadecode.presets import preset_config
from test_layering import PKG, import_graph

BACKENDS = ("torch", "graph", "fused", "mega")
# What a backend may import of another: the reference's executor and ops (graph builds on the torch step, fused on
# the graph step and the reference ops, mega and pyvm on the reference prefill). Everything else is internal.
PUBLIC = {"megadecode.backends.torch.executor", "megadecode.backends.torch.ops", "megadecode.backends.graph.executor"}


def _backend(module: str) -> str | None:
    p = module.split(".")
    return p[2] if len(p) > 2 and p[1] == "backends" and p[2] in BACKENDS else None


def test_no_backend_imports_another_backends_internals():
    bad = [f"{m} imports {d}" for m, deps in sorted(import_graph().items()) for d in sorted(deps)
           if _backend(m) and _backend(d) and _backend(d) != _backend(m) and d not in PUBLIC]
    assert bad == []


def test_the_boundary_check_sees_a_planted_reach_across():
    g = import_graph()
    g["megadecode.backends.fused.kernels.cute_experts"] |= {"megadecode.backends.mega.cute.base"}
    bad = [d for m, deps in g.items() for d in deps if _backend(m) and _backend(d) and _backend(d) != _backend(m)
           and d not in PUBLIC]
    assert bad == ["megadecode.backends.mega.cute.base"]


def test_the_engine_reaches_executors_only_through_the_protocol():
    """engine.py imports the registry and the protocol, never an executor module, and probes nothing with getattr."""
    src = (PKG / "engine.py").read_text()
    tree = ast.parse(src)
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert {m for m in imported if m.startswith("backends")} == {"backends", "backends.base"}
    probes = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "getattr"
              and ast.unparse(n.args[0]).endswith("executor")]
    assert probes == []


@pytest.mark.parametrize("name", sorted(EXECUTORS))
def test_every_executor_implements_the_protocol(name):
    cls = EXECUTORS[name]
    assert issubclass(cls, ExecutorBase) and cls.name == name
    members = [m for m in dir(Executor) if not m.startswith("_")] + list(Executor.__annotations__)
    assert [m for m in members if not hasattr(cls, m) and m != "first_nonfinite"] == []  # that one: per instance


@pytest.mark.parametrize("name", ["torch", "graph", "pyvm"])
def test_an_executor_built_on_the_cpu_is_an_executor(name):
    from megadecode.engine import Engine

    eng = Engine.from_pretrained("tiny-qwen3-moe", executor=name, max_batch=1, max_seq_len=16)
    assert isinstance(eng.executor, Executor) and eng.executor.set_sampling(None, 1) is False


def test_the_registry_names_the_executors_of_every_family():
    for fam in REGISTRY.values():
        assert set(fam.executors) <= set(EXECUTORS), fam.name
        assert "torch" in fam.executors  # the reference runs everything
    assert set(EXECUTOR_NAMES) == set(EXECUTORS)  # the command line offers every executor, from the table alone
    assert families_for("mega") == ("qwen3_moe", "deepseek_v3", "kimi_k3")
    why = executor_refusal("mega", "kimi_linear")
    assert "not validated for kimi_linear" in why and "torch, graph, fused" in why
    assert EXECUTORS["compiled"].supports(preset_config("tiny-deepseek-v3")) is not None
    assert EXECUTORS["compiled"].supports(preset_config("tiny-qwen3-moe")) is None


def test_an_executor_not_validated_for_the_family_is_refused_in_one_line():
    from megadecode.engine import Engine, RequestError

    with pytest.raises(RequestError, match="the mega executor cannot run kimi_linear: the mega executor is not validated"):
        Engine.from_pretrained("tiny-kimi-linear", executor="mega")


def test_the_family_registry_is_the_only_list_of_families():
    """No package module outside config/registry.py holds a list of two or more family names as a constant (a
    variant's Scope(families=...) declares its scope, checked against the registry when it is made)."""
    found = []
    for path in PKG.rglob("*.py"):
        if path == PKG / "config" / "registry.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, (ast.Tuple, ast.List)):
                vals = [e.value for e in node.value.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
                if len(vals) >= 2 and set(vals) <= set(FAMILIES):
                    found.append(f"{path.relative_to(PKG.parent)}:{node.lineno}")
    assert found == []
    from megadecode.contract import Scope

    with pytest.raises(ValueError, match="unregistered families"):
        Scope(families=("qwen3_moe", "llama"))


def test_model_types_come_from_the_registry():
    from megadecode.config import MODEL_TYPES, PARSERS

    assert MODEL_TYPES["kimi_k2"] == "deepseek_v3" and set(MODEL_TYPES) == set(PARSERS)
    assert set(MODEL_TYPES.values()) == set(FAMILIES) and Path(PKG / "config" / "registry.py").is_file()


def test_the_package_holds_no_commit_hashes():
    """History lives in git and docs/: a comment or docstring in the package names no commit (a 7-12 digit hex word
    with letters and digits, the way the journal cites them)."""
    import re

    word = re.compile(r"(?<![\w.#/-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,12}(?![\w-])")
    found = [f"{p.relative_to(PKG.parent)}:{n}: {m.group(0)}" for p in sorted(PKG.rglob("*.py")) + sorted(PKG.rglob("*.md"))
             for n, line in enumerate(p.read_text().splitlines(), 1) for m in word.finditer(line)]
    assert found == []
