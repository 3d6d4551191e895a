"""Which Triton kernels a variant launches, against what its manifest declares (Manifest.kernels).

The static audit covers the declared kernels only, so a kernel or a launch specialization a variant runs without
declaring it would go unaudited. `record_launches()` records every Triton launch inside its block (the kernel's
"module.qualname" and its scalar arguments: constexprs included, defaults applied) by wrapping
`KernelInterface.__getitem__` (the `kernel[grid](...)` call, the same for compiled and interpreted kernels) for
the duration of the block; `undeclared()` names each launch no declared spec admits (contract/kernels.py: same
kernel, same path constexprs). The harness runs every variant under it (validate/checks.py run_variant).
Only Triton launches are seen; a kernel of another framework is checked by its audit alone.
"""

from __future__ import annotations

import inspect
import sys
from contextlib import contextmanager
from functools import lru_cache

from ..contract.kernels import kernel_id, path_value


@lru_cache(maxsize=None)
def _params(fn) -> tuple[tuple[str, object], ...]:
    """(name, default or inspect.Parameter.empty) of a kernel's Python function."""
    return tuple((n, p.default) for n, p in inspect.signature(fn).parameters.items())


def _python_fn(k):
    while hasattr(k, "fn"):
        k = k.fn
    return k


def _scalars(k, args, kwargs) -> dict:
    """The launch's non-tensor arguments by name (defaults applied; launch options such as num_warps dropped)."""
    params = _params(_python_fn(k))
    out = {n: d for n, d in params if d is not inspect.Parameter.empty}
    out.update({n: a for (n, _), a in zip(params, args)})
    names = {n for n, _ in params}
    out.update({n: v for n, v in kwargs.items() if n in names})
    return {n: v for n, v in out.items() if isinstance(v, (bool, int, float, str)) or v is None}


@contextmanager
def record_launches():
    """Yields a list that receives (kernel id, scalar arguments) for every Triton launch in the block. Nothing is
    patched when Triton has not been imported (no Triton kernel can run then)."""
    launches: list[tuple[str, dict]] = []
    jit = sys.modules.get("triton.runtime.jit")
    if jit is None:
        yield launches
        return
    cls = jit.KernelInterface
    original = cls.__getitem__

    def getitem(self, grid):
        launcher = original(self, grid)

        def launch(*args, **kwargs):
            launches.append((kernel_id(self), _scalars(self, args, kwargs)))
            return launcher(*args, **kwargs)
        return launch

    cls.__getitem__ = getitem
    try:
        yield launches
    finally:
        cls.__getitem__ = original


def undeclared(launches: list[tuple[str, dict]], specs: list) -> list[str]:
    """One message per distinct launch that no declared spec admits (kernel not declared, or declared at other
    path constexprs)."""
    by_kernel: dict[str, list] = {}
    for s in specs:
        by_kernel.setdefault(s.kernel_id, []).append(s)
    msgs: list[str] = []
    for kid, args in launches:
        name = kid.rsplit(".", 1)[-1]
        cands = by_kernel.get(kid)
        if not cands:
            m = f"launched Triton kernel {name} ({kid}), which its manifest does not declare (Manifest.kernels)"
        elif not any(s.admits(args) for s in cands):
            path = {k: path_value(args.get(k)) for k in cands[0].path}
            declared = "; ".join(str(s.path_values()) for s in cands)
            m = (f"launched {name} at {path}, a specialization its manifest does not declare (declared: {declared}): "
                 "that code path is never audited")
        else:
            continue
        if m not in msgs:
            msgs.append(m)
    return msgs
