"""Static instruction mix of the routed-expert kernels' inner loops, compiled for sm_90 on any machine
(no GPU): warp-instructions issued per weight streamed, a proxy for how far an ALU-heavy decode can keep up
with HBM (the H200 issues ~1.05e12 warp-instructions/s by its specification, 132 SMs x 4 schedulers x ~1.98 GHz,
not measured; it must consume ~9.1e12 MXFP4 weights/s at the measured 4.57 TB/s,
so ~0.11 warp-instructions per weight is the budget). Reported for the innermost loop of the gate/up kernel.
Triton's own `tl.dot_scaled` on the same tile (0.272, docs/evidence/experts-paths-h200.md) was a case here
until its probe kernel left the tree (`git log -- bench/mxfp4_dot_probe.py`).

    python bench/sass_mix.py
"""

from __future__ import annotations

import collections

from megadecode.backends.fused.kernels import fused_experts as fe
from megadecode.backends.fused.kernels import grouped_experts as ge
from megadecode.validate.audit import disassemble, sass_loops


def compile_kernel(fn, sig, consts):
    """sm_90 compile with every pointer and integer argument marked divisible by 16, as Triton's launcher
    specializes them at run time for these shapes (without the hint, loads are not vectorized)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a, t in sig.items()
             if t != "constexpr" and (t.startswith("*") or t == "i32")}
    return triton.compile(ASTSource(fn, dict(sig), dict(consts), attrs=attrs), target=GPUTarget("cuda", 90, 32))


def inner_loops(fn, sig, consts):
    """[(instructions, opcode Counter)] of every backward-branch loop in the kernel's SASS (opcodes without their
    modifiers)."""
    sass, why = disassemble(compile_kernel(fn, sig, consts).asm["cubin"])
    if sass is None:
        raise SystemExit(why)
    out = []
    for _, _, mix in sass_loops(sass):
        base = collections.Counter()
        for op, n in mix.items():
            base[op.split(".")[0]] += n
        out.append((sum(mix.values()), base))
    return out


def main():
    num_warps = 4  # compile_kernel's default
    cases = []
    for spec in fe.audit_specs("fp32", True, "situ", D=3584, I=3072, A=16)[:1]:
        fn, sig, consts = spec.fn, spec.signature, spec.constexprs
        cases.append(("fused FMA (backends/fused/kernels/fused_experts.py)", fn, sig, consts,
                      consts["BLOCK_I"] * consts["BLOCK_D"]))
    for fast in (False, True):
        spec = ge.audit_specs("fp32", True, "situ", grouped=True, fast=fast)[0]
        fn, sig, consts = spec.fn, spec.signature, spec.constexprs
        per_iter = consts["BLOCK_I"] * (consts["BLOCK_D"] if fast else 32)
        cases.append((f"tensor cores, {'fast inline-PTX' if fast else 'exact per-32-block'} decode", fn, sig, consts,
                      per_iter))
    print(f"{'kernel (K3 gate/up, MXFP4)':<48} {'loop instrs':>11} {'weights/iter':>12} {'warp-instr/weight':>17}  top opcodes")
    for name, fn, sig, consts, per_iter in cases:
        n, mix = min(inner_loops(fn, sig, consts), key=lambda t: t[0])
        print(f"{name:<48} {n:>11} {per_iter:>12} {n * num_warps / per_iter:>17.3f}  "
              + ", ".join(f"{k} {v}" for k, v in mix.most_common(6)))


if __name__ == "__main__":
    main()
