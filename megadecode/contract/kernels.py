"""What a variant declares about the kernels it runs (Manifest.kernels), for the static memory-ordering audit
(megadecode.validate.audit) and the harness's launch check (megadecode.validate.launches).

A variant's `Manifest.kernels()` returns one spec per compiled kernel and launch specialization it can run, every
code path included (MXFP4 fast and exact, per pair and grouped by expert, greedy and sampling...). A spec is any
object with this interface (the audit dispatches through it, never on a kernel framework):

    name: str                 the kernel's name in reports
    kernel_id: str            "module.qualname" of the kernel function: what a launch is matched against
    roles: dict               pointer parameter -> "static" | "produced" | "flag" (below)
    path: tuple[str, ...]     the constexprs that select a code path (a launch must match a declared spec on them)
    key() -> str              stable identity (the audit's cache key)
    compile(arch) -> Compiled PTX (and cubin) for sm_<arch>, without a GPU
    needs_fresh_process() -> bool   True when it cannot compile in this process (Triton under the interpreter)
    portable() -> dict        a JSON description that `from_portable` rebuilds in another process

`KernelSpec` is the Triton form; other forms (CuTe DSL) register a `from_portable` under their "kind"
(`register_spec_kind`). Roles (the rule of SPEC.md: the non-coherent / read-only load path is for static data only):
  "static"    never written during the launch or the decode step (weights, tables, step inputs)
  "produced"  written during the step: must be read with coherent loads
  "flag"      a synchronisation word produced during the launch (spin-waits acquire it, signals release it)

A launch specialization is the tuple of the spec's `path` constexprs, booleans as they are and integers counted
as 0, 1 or more (the branches `if KC > 0`, `if G > 1`, `ACT == 0` select on that). By default the path is every
boolean constexpr except those named `free`: the ones the dtype or the device decides (IEEE dots for fp32,
hi/lo splits, inline PTX only off the interpreter), since the audit compiles the bf16 GPU form.
No heavy imports here: triton is imported inside `compile`.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple


ROLES = ("static", "produced", "flag")


class Compiled(NamedTuple):
    ptx: str
    cubin: bytes | None
    params: list[str]  # runtime parameters in PTX order
    pointer_params: set[str]


def path_value(v):
    """A constexpr value as a launch specialization counts it: booleans as they are, integers as 0, 1 or 2+."""
    if isinstance(v, bool) or not isinstance(v, int):
        return v
    return min(v, 2)


def kernel_id(fn) -> str:
    """"module.qualname" of a @triton.jit function (compiled or interpreted) or a plain function."""
    while hasattr(fn, "fn"):  # JITFunction / InterpretedFunction / Autotuner wrap the Python function
        fn = fn.fn
    return f"{fn.__module__}.{fn.__qualname__}"


@dataclass(frozen=True, eq=False)
class KernelSpec:
    """A Triton kernel at one launch specialization: the @triton.jit function, its argument types (constexprs
    marked "constexpr"), the role of every pointer parameter, the constexpr values, and the path constexprs."""

    fn: object
    signature: dict
    roles: dict
    constexprs: dict
    path: tuple[str, ...] = field(default=())

    @property
    def name(self) -> str:
        return kernel_id(self.fn).rsplit(".", 1)[-1]

    @property
    def kernel_id(self) -> str:
        return kernel_id(self.fn)

    def path_values(self) -> dict:
        return {k: path_value(self.constexprs[k]) for k in self.path}

    def admits(self, args: dict) -> bool:
        """Whether a launch with these argument values runs this spec's code path."""
        return all(path_value(args.get(k)) == v for k, v in self.path_values().items())

    def key(self) -> str:
        return json.dumps(["triton", self.kernel_id, self.signature, self.roles, self.constexprs], sort_keys=True,
                          default=str)

    def needs_fresh_process(self) -> bool:
        from .variant import triton_interpreted

        return triton_interpreted(self.fn)

    def check(self) -> tuple[list[str], set[str]]:
        """(runtime parameters in order, pointer parameters), or ValueError naming what does not fit the kernel:
        checked before compiling, and in this process even when the compile happens in another."""
        names = list(self.fn.arg_names)
        unknown = set(self.signature) - set(names)
        if unknown:
            raise ValueError(f"signature names arguments {self.name} does not have: {sorted(unknown)}")
        absent = [a for a in names if a not in self.signature]
        if absent:
            raise ValueError(f"signature misses arguments of {self.name}: {absent}")
        need = [a for a, t in self.signature.items() if t == "constexpr" and a not in self.constexprs]
        if need:
            raise ValueError(f"constexpr arguments without a value: {need}")
        bad = {p: r for p, r in self.roles.items() if r not in ROLES}
        if bad:
            raise ValueError(f"unknown roles {bad}; roles are {ROLES}")
        params = [a for a in names if self.signature[a] != "constexpr"]
        missing = set(self.roles) - set(params)
        if missing:
            raise ValueError(f"roles name parameters the kernel does not have: {sorted(missing)}")
        pointers = {a for a in params if self.signature[a].startswith("*")}
        notptr = [p for p in self.roles if p not in pointers]
        if notptr:
            raise ValueError(f"roles given for non-pointer parameters: {notptr}")
        return params, pointers

    def compile(self, arch: int = 90) -> Compiled:
        """triton.compile for cuda:<arch> without a GPU."""
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        params, pointers = self.check()
        k = triton.compile(ASTSource(self.fn, dict(self.signature), dict(self.constexprs)),
                           target=GPUTarget("cuda", arch, 32))
        return Compiled(k.asm["ptx"], k.asm.get("cubin"), params, pointers)

    def portable(self) -> dict:
        py = self.fn
        while hasattr(py, "fn"):
            py = py.fn
        try:
            src = inspect.getsourcefile(py)
        except TypeError:
            src = None
        return {"kind": "triton", "module": py.__module__, "qualname": py.__qualname__, "file": src,
                "signature": self.signature, "roles": self.roles,
                "constexprs": {k: _encode_constexpr(v) for k, v in self.constexprs.items()}, "path": list(self.path)}

    @classmethod
    def from_portable(cls, d: dict) -> "KernelSpec":
        return cls(_import_object(d["module"], d["qualname"], d.get("file")), d["signature"], d["roles"],
                   {k: _decode_constexpr(v) for k, v in d["constexprs"].items()}, tuple(d["path"]))


def _encode_constexpr(v):
    """A constexpr as JSON: a Triton dtype (a kernel's compute dtype) travels by its name."""
    if type(v).__name__ == "dtype" and type(v).__module__.startswith("triton"):
        return {"triton_dtype": v.name}
    return v


def _decode_constexpr(v):
    if isinstance(v, dict) and set(v) == {"triton_dtype"}:
        import triton.language as tl

        return tl.dtype(v["triton_dtype"])
    return v


def _import_object(module: str, qualname: str, file: str | None):
    """The object `qualname` of `module`, imported by name, else loaded from its source file."""
    if module == "__main__":
        raise ImportError(f"{qualname} is defined in __main__: another process cannot import it")
    try:
        obj = importlib.import_module(module)
    except ImportError:
        if not file:
            raise
        spec = importlib.util.spec_from_file_location(f"_megadecode_audit_{abs(hash(file))}", file)
        obj = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(obj)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


SPEC_KINDS: dict[str, Callable[[dict], object]] = {"triton": KernelSpec.from_portable}


def register_spec_kind(kind: str, from_portable: Callable[[dict], object]) -> None:
    """Make specs of another kernel framework rebuildable in the audit's fresh process."""
    SPEC_KINDS[kind] = from_portable


def from_portable(d: dict):
    if d.get("kind") not in SPEC_KINDS:
        raise ValueError(f"unknown kernel spec kind {d.get('kind')!r}; known: {sorted(SPEC_KINDS)}")
    return SPEC_KINDS[d["kind"]](d)


def kernel_spec(fn, runtime_sig: dict, consts: dict, static: tuple[str, ...] = (), path: tuple[str, ...] | None = None,
                free: tuple[str, ...] = ()) -> KernelSpec:
    """The KernelSpec of `fn` as the kernel modules build them: the constexprs marked in the signature; every
    pointer parameter (named ..._ptr) holds data produced within the step unless it is named in `static` (weights,
    tables). `path`: the constexprs that select a code path; None: the boolean ones not named in `free`."""
    sig = {**runtime_sig, **{k: "constexpr" for k in consts}}
    roles = {n: ("static" if n in static else "produced") for n in sig if n.endswith("_ptr")}
    if path is None:
        path = tuple(k for k, v in consts.items() if isinstance(v, bool) and k not in free)
    missing = [k for k in path if k not in consts]
    if missing:
        raise ValueError(f"path constexprs without a value: {missing}")
    return KernelSpec(fn, sig, roles, dict(consts), tuple(path))
