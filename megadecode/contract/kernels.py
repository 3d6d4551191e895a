"""What a kernel declares for the static memory-ordering audit (megadecode.validate.audit).

A kernel module's `audit_specs(...)` returns one KernelSpec per compiled kernel and launch specialization it
runs: the @triton.jit function, its argument types (constexprs marked "constexpr"), the role of every pointer
parameter, and the constexpr values. Roles (the rule of SPEC.md: the non-coherent / read-only load path is for
static data only):
  "static"    never written during the launch or the decode step (weights, tables, step inputs)
  "produced"  written during the step: must be read with coherent loads
  "flag"      a synchronisation word produced during the launch (spin-waits acquire it, signals release it)
"""

from __future__ import annotations

from typing import NamedTuple


class KernelSpec(NamedTuple):
    fn: object  # the @triton.jit function
    signature: dict  # argument name -> Triton type ("*bf16", "i32", ...) or "constexpr"
    roles: dict  # pointer parameter -> "static" | "produced" | "flag"
    constexprs: dict


def kernel_spec(fn, runtime_sig: dict, consts: dict, static: tuple[str, ...] = ()) -> KernelSpec:
    """The KernelSpec of `fn` as the kernel modules' audit_specs build them: the constexprs marked in the
    signature; every pointer parameter (named ..._ptr) holds data produced within the step unless it is named in
    `static` (weights, tables)."""
    sig = {**runtime_sig, **{k: "constexpr" for k in consts}}
    roles = {n: ("static" if n in static else "produced") for n in sig if n.endswith("_ptr")}
    return KernelSpec(fn, sig, roles, consts)
