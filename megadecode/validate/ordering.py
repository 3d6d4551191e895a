"""Hunting ordering bugs that functional tests miss: static audits of compiled kernels (CPU, sm_90
PTX/SASS) and a dynamic audit on the GPU (random delays at chosen points, fresh inputs per launch,
bitwise repeat checks) over the persistent handoff kernel and its planted mistakes.

Which placement exposes what (our H200, /work/shared/GPU.md): a delay before the producer's stores
exposes readers that do not really wait; a delay right after the signal exposes a signal that
precedes its data. A missing release showed at runtime in no placement: only the static audit
(`atom...relaxed` in the PTX) catches it. So a broken variant counts as caught when any check,
static or dynamic, fails; a correct one must pass every check.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass

import torch

from . import audit as A

# name -> planted flags of megadecode.validate.handoff (one mistake each)
HANDOFF_VARIANTS = {
    "handoff": {},
    "broken-handoff-hoist-nc": {"HOIST": True},  # produced data through the non-coherent path
    "broken-handoff-load-before-wait": {"LOAD_BEFORE_WAIT": True},  # activation load above its wait
    "broken-handoff-no-acquire": {"NO_ACQUIRE": True},
    "broken-handoff-relaxed-signal": {"RELAXED_SIGNAL": True},
    "broken-handoff-signal-before-store": {"SIGNAL_BEFORE_STORE": True},
}
JITTER = (None, "before_store", "after_signal")


def static_audit(name: str) -> A.AuditReport:
    from . import handoff as H

    return A.audit_kernel(H.handoff_kernel, H.handoff_signature(), H.PARAM_ROLES,
                          H.handoff_constexprs(**HANDOFF_VARIANTS[name]))


@dataclass
class AuditSummary:
    """An audit run in another process: its verdict and its markdown."""

    passed: bool
    markdown: str

    def to_markdown(self) -> str:
        return self.markdown


def kernel_audits(variant: str) -> list:
    """Static audits of the Triton kernels a plan-op variant launches, at sm_90, in bf16: activations
    (produced during a step) must be read through coherent loads.

    Kernels decorated under the Triton interpreter cannot be compiled: then the audit runs in a fresh
    process without TRITON_INTERPRET and comes back as AuditSummary objects."""
    from triton.runtime.jit import JITFunction

    from ..kernels import rmsnorm, router

    if not all(isinstance(k, JITFunction) for k in (rmsnorm.rmsnorm_kernel, router.router_kernel)):
        code = ("import json, sys; from megadecode.validate.ordering import kernel_audits; "
                "print(json.dumps([[r.passed, r.to_markdown()] for r in kernel_audits(sys.argv[1])]))")
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        out = subprocess.run([sys.executable, "-c", code, variant], env=env, capture_output=True, text=True,
                             check=True, timeout=600).stdout
        return [AuditSummary(p, md) for p, md in json.loads(out.strip().splitlines()[-1])]
    return _kernel_audits(variant)


def _kernel_audits(variant: str) -> list[A.AuditReport]:
    if variant == "triton-rmsnorm":
        from ..kernels.rmsnorm import rmsnorm_kernel

        sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "T": "i32", "stride_x": "i32",
               "stride_out": "i32", "eps": "fp32", "D": "constexpr", "BLOCK_T": "constexpr", "BLOCK_D": "constexpr"}
        return [A.audit_kernel(rmsnorm_kernel, sig, {"x_ptr": "produced", "w_ptr": "static", "out_ptr": "produced"},
                               {"D": 2048, "BLOCK_T": 4, "BLOCK_D": 2048})]
    if variant == "triton-router":
        from ..kernels.linear import audit_specs as linear_specs
        from ..kernels.router import router_kernel

        sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*fp32", "ids_ptr": "*i64", "wts_ptr": "*fp32",
               "s_ptr": "*fp32", "T": "i32", "stride_x": "i32", "stride_w": "i32", "scale": "fp32"}
        roles = {"x_ptr": "produced", "w_ptr": "static", "bias_ptr": "static", "ids_ptr": "produced",
                 "wts_ptr": "produced", "s_ptr": "produced"}
        reports = []
        for pre in (False, True):  # the one-kernel form and the selection kernel after the projection
            consts = {"D": 2048, "E": 128, "SIGMOID": False, "HAS_BIAS": False, "NORM": True, "G": 1,
                      "TOPK_GROUP": 1, "A": 8, "BLOCK_T": 16, "BLOCK_E": 128, "BLOCK_D": 64, "BLOCK_A": 8,
                      "BLOCK_G": 1, "PRESCORED": pre, "KS": 8 if pre else 1}
            reports.append(A.audit_kernel(router_kernel, {**sig, **{k: "constexpr" for k in consts}}, roles, consts))
        fn, lsig, lroles, lconsts = linear_specs("bf16", norm=False, K=2048, N=128)[0]
        lsig = {**lsig, "x_ptr": "*bf16", "out_ptr": "*fp32"}
        return reports + [A.audit_kernel(fn, lsig, lroles, lconsts)]
    if variant == "triton-add-rmsnorm":
        from ..kernels.rmsnorm import add_rmsnorm_kernel

        sig = {"a_ptr": "*bf16", "b_ptr": "*bf16", "w_ptr": "*bf16", "sum_ptr": "*bf16", "out_ptr": "*bf16",
               "T": "i32", "stride_a": "i32", "stride_b": "i32", "stride_s": "i32", "stride_out": "i32",
               "eps": "fp32", "D": "constexpr", "BLOCK_T": "constexpr", "BLOCK_D": "constexpr"}
        roles = {"a_ptr": "produced", "b_ptr": "produced", "w_ptr": "static", "sum_ptr": "produced",
                 "out_ptr": "produced"}
        return [A.audit_kernel(add_rmsnorm_kernel, sig, roles, {"D": 2048, "BLOCK_T": 2, "BLOCK_D": 2048})]
    # the other variants: their kernel module's audit_specs() (the kernels it launches, default shapes)
    import importlib

    from .catalog import get

    v = get(variant)
    mod = importlib.import_module(v.kernel.__module__) if getattr(v, "kernel", None) is not None else None
    if mod is None or not hasattr(mod, "audit_specs"):
        return []
    return [A.audit_kernel(fn, sig, roles, consts) for fn, sig, roles, consts in mod.audit_specs()]


def _launch_inputs(M, K, N, S, gen):
    W = torch.randn(M, K, device="cuda", generator=gen) / K ** 0.5
    V = torch.randn(N, M, device="cuda", generator=gen) / M ** 0.5
    x = torch.randn(S, K, device="cuda", generator=gen)
    return W, x, V


def dynamic_audit(name: str, *, launches: int = 100, M: int = 1024, K: int = 2048, N: int = 1024, S: int = 32,
                  max_delay_ns: int = 20_000, seed: int = 0) -> list[dict]:
    """On the GPU: for each jitter placement, `launches` launches with fresh random inputs (and fresh
    random delays in [0, max_delay_ns)), each compared with the fp64 reference; plus, without jitter,
    two launches on the same inputs must be bitwise identical. One row per (placement | repeat)."""
    from . import handoff as H

    planted = HANDOFF_VARIANTS[name]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    P = -(-M // 16)
    rows = []
    for jitter in JITTER:
        wrong = timeouts = 0
        worst = 0.0
        for _ in range(launches):
            W, x, V = _launch_inputs(M, K, N, S, gen)
            delays = torch.randint(0, max_delay_ns, (P, S), device="cuda", generator=gen, dtype=torch.int32)
            z, err = H.handoff(W, x, V, jitter=jitter, delays_ns=delays if jitter else None, **planted)
            ref = H.handoff_reference(W, x, V)
            rel = ((z - ref).abs().max() / ref.abs().max()).item() if torch.isfinite(z).all() else float("inf")
            worst = max(worst, rel)
            wrong += rel > 1e-4
            timeouts += int((err != 0).any().item())
        rows.append({"variant": name, "check": f"jitter:{jitter or 'none'}", "launches": launches,
                     "wrong": int(wrong), "timeouts": timeouts, "max_rel_err": worst,
                     "status": "PASS" if wrong == 0 and timeouts == 0 else "FAIL"})
    W, x, V = _launch_inputs(M, K, N, S, gen)
    same = all(torch.equal(H.handoff(W, x, V, **planted)[0], H.handoff(W, x, V, **planted)[0]) for _ in range(5))
    rows.append({"variant": name, "check": "repeat-bitwise", "launches": 10, "status": "PASS" if same else "FAIL"})
    return rows


def run_ordering(*, launches: int = 100, gpu: bool | None = None) -> tuple[list[dict], list[str]]:
    """Every handoff variant: static audit always, dynamic audit when a GPU is present. Adds a verdict
    row per variant: correct ones must pass everything, broken ones must be caught by something.
    Returns (rows, the static audits as markdown, one per variant, titled with its name)."""
    gpu = torch.cuda.is_available() if gpu is None else gpu
    rows, reports = [], []
    for name in HANDOFF_VARIANTS:
        rep = static_audit(name)
        reports.append(f"#### {name}\n\n{rep.to_markdown()}")
        own = [{"variant": name, "check": "static-audit", "status": "PASS" if rep.passed else "FAIL",
                "findings": ",".join(sorted({f.rule for f in rep.errors})) or None}]
        if gpu:
            own += dynamic_audit(name, launches=launches)
        failed = [r["check"] for r in own if r["status"] == "FAIL"]
        broken = name.startswith("broken-")
        ok = bool(failed) if broken else not failed
        status, reason = ("PASS", None) if ok else ("FAIL", "not caught" if broken else "correct variant flagged")
        if broken and not failed and not gpu:
            status, reason = "SKIP", "not caught by the static audit; the dynamic audit needs a GPU"
        rows += own
        rows.append({"variant": name, "check": "verdict", "expected": "flagged" if broken else "clean",
                     "caught_by": ",".join(failed) or None, "status": status, "reason": reason})
    return rows, reports
