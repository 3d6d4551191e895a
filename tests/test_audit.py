"""Static ordering audit (sm_90 compiles on the CPU) and the handoff kernel under the interpreter.

The correct handoff kernel audits clean; each planted mistake is flagged by its rule; static weights
read through the non-coherent path are reported as such and not flagged (PTX and, with nvdisasm,
SASS); under TRITON_INTERPRET=1 the kernel matches the torch reference and a wait whose producers
never signal reports ERR_WAIT_TIMEOUT instead of hanging.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")

from megadecode.validate import handoff as H  # noqa: E402
from megadecode.validate import audit as A  # noqa: E402
from megadecode.validate.kernel_audit import audit_kernel  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@functools.lru_cache(maxsize=None)
def _audit(*planted: str, sass: bool = True) -> A.AuditReport:
    consts = H.handoff_constexprs(**{p: True for p in planted})
    return audit_kernel(H.handoff_kernel, H.handoff_signature(), H.PARAM_ROLES, consts, sass=sass)


def _rules(rep: A.AuditReport, severity: str = "error") -> set[str]:
    return {f.rule for f in rep.findings if f.severity == severity}


def test_correct_kernel_audits_clean():
    rep = _audit()
    assert rep.findings == [], rep.to_markdown()
    assert rep.passed
    for rule in (A.R_NC, A.R_ACQ, A.R_REL, A.R_ORDER):
        assert rule in rep.rules_checked
    # the static weights do go through the non-coherent path, and only they do
    assert {p for _, ps in rep.nc_loads for p in ps} == {"W", "V"}
    assert all(ps for _, ps in rep.nc_loads)  # every .nc load attributed
    md = rep.to_markdown()
    assert "PASS" in md and "handoff_kernel" in md and "No findings" in md


def test_hoist_flagged_as_nc_load_of_produced():
    rep = _audit("HOIST")
    assert not rep.passed
    hits = [f for f in rep.by_rule(A.R_NC) if f.severity == "error"]
    assert [f.params for f in hits] == [("Y",)], rep.to_markdown()
    assert "ld.global.nc" in hits[0].text
    assert _rules(rep) <= {A.R_NC, A.R_SASS}


def test_no_acquire_flagged():
    rep = _audit("NO_ACQUIRE")
    hits = rep.by_rule(A.R_ACQ)
    assert hits and all(f.severity == "error" and f.params == ("FLAGS",) for f in hits), rep.to_markdown()
    assert "volatile" in hits[0].text
    assert _rules(rep) == {A.R_ACQ}


def test_relaxed_signal_flagged():
    rep = _audit("RELAXED_SIGNAL")
    hits = rep.by_rule(A.R_REL)
    assert hits and "relaxed" in hits[0].text and hits[0].params == ("FLAGS",), rep.to_markdown()
    assert _rules(rep) == {A.R_REL}


def test_signal_before_store_flagged():
    rep = _audit("SIGNAL_BEFORE_STORE")
    hits = rep.by_rule(A.R_ORDER)
    assert hits and hits[0].params == ("Y",), rep.to_markdown()
    assert _rules(rep) == {A.R_ORDER}
    assert "FAIL" in rep.to_markdown()


def test_sass_static_nc_loads_not_flagged():
    assert A.tool("nvdisasm") is not None, "nvdisasm (shipped in triton/backends/nvidia/bin) is needed for the SASS rule"
    rep = _audit()
    assert A.R_SASS in rep.rules_checked and A.R_SASS not in rep.skipped
    assert rep.sass_nc_loads, "static weights should appear as LDG...CONSTANT in SASS"
    assert {p for _, ps in rep.sass_nc_loads for p in ps} == {"W", "V"}
    assert not rep.by_rule(A.R_SASS)
    hoisted = _audit("HOIST")
    assert any(f.severity == "error" and "Y" in f.params for f in hoisted.by_rule(A.R_SASS))


def test_sass_skip_has_reason():
    rep = _audit(sass=False)
    assert A.R_SASS in rep.skipped and rep.skipped[A.R_SASS]
    assert "SKIP" in rep.to_markdown()


def test_roles_are_validated():
    sig, consts = H.handoff_signature(), H.handoff_constexprs()
    with pytest.raises(ValueError, match="unknown roles"):
        audit_kernel(H.handoff_kernel, sig, {"W": "weights"}, consts, sass=False)
    with pytest.raises(ValueError, match="does not have"):
        audit_kernel(H.handoff_kernel, sig, {"nope": "static"}, consts, sass=False)
    with pytest.raises(ValueError, match="non-pointer"):
        audit_kernel(H.handoff_kernel, sig, {"K": "static"}, consts, sass=False)
    with pytest.raises(ValueError, match="without a value"):
        audit_kernel(H.handoff_kernel, sig, H.PARAM_ROLES, {}, sass=False)


PTX_HEAD = """
.visible .entry k(
\t.param .u64 .ptr .global .align 1 k_param_0,
\t.param .u64 .ptr .global .align 1 k_param_1,
\t.param .u64 .ptr .global .align 1 k_param_2
)
{
\tld.param.b64 \t%rd1, [k_param_0];
\tld.param.b64 \t%rd2, [k_param_1];
\tld.param.b64 \t%rd3, [k_param_2];
\tmad.wide.s32 \t%rd4, %r1, 4, %rd1;
"""


def _ptx_audit(body: str, roles=None) -> A.AuditReport:
    roles = roles or {"data": "produced", "flag": "flag", "w": "static"}
    return A.audit_ptx(PTX_HEAD + textwrap.dedent(body) + "}\n", ["data", "flag", "w"], roles)


def test_ptx_fences_stand_in_for_acquire_and_release():
    rep = _ptx_audit("""
        st.global.b32 [ %rd4 + 0 ], %r2;
        fence.acq_rel.gpu;
        atom.global.gpu.relaxed.add.u32 %r3, [ %rd2 + 0 ], %r4;
        ld.relaxed.gpu.global.b32 %r5, [ %rd2 + 0 ];
        fence.acq_rel.gpu;
        ld.global.cg.b32 %r6, [ %rd4 + 0 ];
    """)
    assert rep.findings == [], rep.to_markdown()
    rep = _ptx_audit("""
        st.global.b32 [ %rd4 + 0 ], %r2;
        atom.global.cta.release.add.u32 %r3, [ %rd2 + 0 ], %r4;
        ld.acquire.cta.global.b32 %r5, [ %rd2 + 0 ];
        ld.global.b32 %r6, [ %rd4 + 0 ];
    """)
    assert _rules(rep) == {A.R_ACQ, A.R_REL}, rep.to_markdown()  # cta scope is too narrow across CTAs


def test_ptx_nc_attribution():
    rep = _ptx_audit("""
        add.s64 %rd5, %rd3, 64;
        ld.global.nc.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd5 + 0 ];
        ld.global.nc.b32 %r7, [%rd4];
        ld.global.b64 %rd6, [ %rd5 + 0 ];
        ld.global.nc.b32 %r8, [%rd6];
    """)
    assert [(f.rule, f.severity, f.params) for f in rep.findings] == [
        (A.R_NC, "error", ("data",)), (A.R_NC, "warn", ())], rep.to_markdown()
    assert "unattributed" in rep.findings[1].text
    assert A.R_ACQ in rep.rules_checked and A.R_SASS in rep.skipped


def test_roles_from_plan():
    from megadecode.plan import build_plan
    from megadecode.presets import preset_config
    plan = build_plan(preset_config("tiny-qwen3-moe"))
    w = sorted(plan.weight_names())[0]
    roles = A.roles_from_plan(plan, {"x": "normed", "w": w, "tok": "tokens"}, flags=("f",))
    assert roles == {"x": "produced", "w": "static", "tok": "static", "f": "flag"}


def test_launcher_validates_inputs():
    import torch
    W, x, V = torch.randn(8, 4), torch.randn(2, 4), torch.randn(6, 8)
    with pytest.raises(ValueError, match="shape"):
        H.handoff(W, torch.randn(2, 5), V)
    with pytest.raises(TypeError, match="fp32"):
        H.handoff(W, x.double(), V)
    with pytest.raises(ValueError, match="contiguous"):
        H.handoff(W, x, torch.randn(8, 6).T)
    with pytest.raises(ValueError, match="power of two"):
        H.handoff(W, x, V, block_m=6)
    with pytest.raises(TypeError, match="planted"):
        H.handoff(W, x, V, HOISTED=True)


INTERP_SCRIPT = """
import json, time, torch
from megadecode.validate.handoff import handoff, handoff_reference, ERR_WAIT_TIMEOUT
torch.manual_seed(0)
W, x, V = torch.randn(24, 40), torch.randn(3, 40), torch.randn(20, 24)
t = time.time()
z, err = handoff(W, x, V, block_m=8, block_n=8, block_k=16)
ok_s = time.time() - t
ref = handoff_reference(W, x, V)
t = time.time()
z2, err2 = handoff(W, x, V, block_m=8, block_n=8, block_k=16, producers_on=False, max_spin=64)
print(json.dumps({"maxerr": (z - ref).abs().max().item(), "scale": ref.abs().max().item(),
                  "err": err.tolist(), "err_off": err2.tolist(), "z_off": z2.abs().max().item(),
                  "timeout_code": int(ERR_WAIT_TIMEOUT), "t_ok": ok_s, "t_off": time.time() - t}))
"""


def test_interpreter_matches_reference_and_times_out():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", INTERP_SCRIPT], env=env, capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["maxerr"] <= 1e-5 * max(1.0, res["scale"]), res
    assert res["err"] == [0] * 6
    # 3 producers (no signal) + 3 consumers that report the timeout and write nothing
    assert res["err_off"] == [0, 0, 0] + [res["timeout_code"]] * 3, res
    assert res["z_off"] == 0.0


def test_report_to_dict_is_json():
    d = _audit("RELAXED_SIGNAL").to_dict()
    assert d["passed"] is False and d["findings"][0]["rule"] == A.R_REL
    json.dumps(d)
