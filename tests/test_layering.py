"""The package's import graph: no cycles, and every import points down the reading order
config -> plan -> op contract -> kernels -> executors -> engine -> command line and harness
(docs/package-layout.md). Imports inside functions count too: a lazy import is still a dependency."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "megadecode"

# Lowest first. A module may import its own layer and the layers below it, never one above.
LAYERS = [
    ("foundation", ("megadecode.config", "megadecode.quant", "megadecode.tokenizer", "megadecode.step",
                    "megadecode.hardware", "megadecode.parallel", "megadecode.disk_cache")),
    ("model", ("megadecode.weights", "megadecode.presets", "megadecode.plan", "megadecode.cache",
               "megadecode.checkpoint", "megadecode.layouts", "megadecode.reference", "megadecode.sampling",
               "megadecode.structured", "megadecode.memory", "megadecode.hub")),
    ("contract", ("megadecode.contract",)),
    ("kernels", ("megadecode.backends.fused.kernels", "megadecode.backends.mega", "megadecode.backends.cute_device",
                 "megadecode.backends.cute_frag", "megadecode.backends.ptxas", "megadecode.backends.base", "megadecode.backends.expert_layout")),
    ("executors", ("megadecode.backends", "megadecode.backends.torch", "megadecode.backends.graph",
                   "megadecode.backends.fused.executor", "megadecode.backends.fused.parallel_moe",
                   "megadecode.backends.mega.executor", "megadecode.backends.mega.pyvm_executor")),
    ("engine", ("megadecode.engine", "megadecode.sequence", "megadecode.scheduler", "megadecode.runner",
                "megadecode.speculative", "megadecode.mtp")),
    ("top", ("megadecode.args", "megadecode.measure", "megadecode.ranks", "megadecode.bench", "megadecode.bench_moe", "megadecode.tune",
             "megadecode.validate", "megadecode.serve", "megadecode.cli", "megadecode.__main__")),
]


def modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = p.with_suffix("").relative_to(PKG.parent).parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (module level or inside functions). The root package's
    lazy re-exports (its __getattr__) are left out: importing a submodule never runs them."""
    mods = modules()
    graph = {}
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        deps = set()
        if name == "megadecode":
            graph[name] = deps
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_pkg else name.split(".")[:-1]
                    base = base[:len(base) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                elif (node.module or "").split(".")[0] == "megadecode":
                    target = node.module
                else:
                    continue
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    deps.add(sub if sub in mods else target)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.split(".")[0] == "megadecode")
        graph[name] = {d for d in deps if d in mods and d != name}
    return graph


def layer_of(module: str) -> int:
    """The layer of the longest prefix that names the module (a backend's executor sits above its kernels)."""
    best = max(((len(p), i) for i, (_, prefixes) in enumerate(LAYERS) for p in prefixes
                if module == p or module.startswith(p + ".")), default=None)
    if best is None:
        raise AssertionError(f"{module} is in no layer of tests/test_layering.py: place it")
    return best[1]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_import_graph_has_no_cycles():
    assert cycles(import_graph()) == []


def test_cycle_finder_finds_a_planted_cycle():
    g = import_graph()
    g["megadecode.config.model"] = g["megadecode.config.model"] | {"megadecode.engine"}
    found = cycles(g)
    assert found and any("megadecode.engine" in c and "megadecode.config.model" in c for c in found)


def test_every_import_points_down_the_layers():
    up = [f"{m} ({LAYERS[layer_of(m)][0]}) imports {d} ({LAYERS[layer_of(d)][0]})"
          for m, deps in import_graph().items() if m != "megadecode" for d in sorted(deps)
          if layer_of(d) > layer_of(m)]
    assert up == []


def test_serving_never_imports_the_harness():
    graph = import_graph()
    serving = [m for m in graph if m != "megadecode" and not m.startswith(("megadecode.validate", "megadecode.cli"))]
    bad = [f"{m} -> {d}" for m in serving for d in graph[m] if d.startswith("megadecode.validate")]
    assert bad == []


@pytest.mark.parametrize("module, absent", [
    ("megadecode.config", ("megadecode.engine", "megadecode.backends.fused.kernels", "megadecode.validate")),
    ("megadecode.contract", ("megadecode.backends.fused.kernels", "megadecode.backends", "megadecode.validate")),
    ("megadecode.engine", ("megadecode.validate",)),
])
def test_importing_a_layer_loads_nothing_above_it(module, absent):
    """At run time too: the root package's re-exports are lazy, so importing a submodule does not pull in the
    engine, and serving does not register the harness's deliberately broken variants."""
    code = (f"import sys, {module}\n"
            f"bad = sorted(m for m in sys.modules if m.startswith({absent!r}))\n"
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
