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

import torch

from . import audit as A
from .kernel_audit import audit_kernel

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

    return audit_kernel(H.handoff_kernel, H.handoff_signature(), H.PARAM_ROLES,
                          H.handoff_constexprs(**HANDOFF_VARIANTS[name]))


def kernel_audits(variant: str) -> list[A.AuditReport]:
    """Static audits of every kernel the registered variant `variant` declares (Manifest.kernels), at sm_90:
    activations (produced during a step) must be read through coherent loads. validate/kernel_audit.py."""
    from .catalog import get
    from .kernel_audit import audit_variant

    return audit_variant(get(variant))


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
