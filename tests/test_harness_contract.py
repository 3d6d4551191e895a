"""The harness's contract checks (issue 12): kernels are declared per variant and registration refuses a Triton
variant without; every Triton launch is checked against the declaration; the static audit runs on declared specs,
for a variant defined anywhere, in every `validate` mode; a NaN the variant computes is reported apart from poison
left; writes outside an output are caught by its guard regions; a run in which nothing ran is not a pass."""

from __future__ import annotations

import pytest
import torch

from interp import DEVICE, import_interpreted, interpreter_env  # noqa: F401 (autouse fixture)

K_NORM = import_interpreted("megadecode.backends.fused.kernels.rmsnorm", "megadecode.validate.catalog")

import harness_kernels  # noqa: E402
from megadecode import plan as P  # noqa: E402
from megadecode.cli import main  # noqa: E402
from megadecode.contract import (  # noqa: E402
    Manifest,
    Scope,
    Variant,
    check_kernels,
    kernel_spec,
    nonfinite,
    poisoned,
    register,
    unwritten,
)
from megadecode.presets import preset_config  # noqa: E402
from megadecode.reference.norm import rms_norm  # noqa: E402
from megadecode.validate import broken_kernels as MUT  # noqa: E402
from megadecode.validate.catalog import all_variants, get  # noqa: E402
from megadecode.validate.checks import run_variant  # noqa: E402
from megadecode.validate.inputs import build_case  # noqa: E402
from megadecode.validate.kernel_audit import audit_specs, audit_variant  # noqa: E402
from megadecode.validate.launches import record_launches, undeclared  # noqa: E402
from megadecode.validate.matrix import run_matrix, verdict  # noqa: E402

QWEN = preset_config("tiny-qwen3-moe")


def _norm(op, inputs, weights, outputs, cfg, step, cache=None):
    """RMSNorm in plain torch (a probe variant that declares no kernel must launch none)."""
    outputs[op.outputs[0]].copy_(rms_norm(inputs[op.inputs[0]], weights[op.weights[0]], cfg.rms_norm_eps))


# ---- declared kernels ---------------------------------------------------------------------------------------------
def test_registration_refuses_triton_variants_that_declare_no_kernels():
    with pytest.raises(ValueError, match="runs Triton kernels but declares none"):
        register(Variant(Manifest("t-undeclared", "t", (P.RMSNORM,), uses_triton=True), _norm))
    with pytest.raises(ValueError, match="runs Triton kernels but declares none"):
        register(Variant(Manifest("t-undeclared2", "t", (P.RMSNORM,)), _norm, kernel=K_NORM.rmsnorm_kernel))
    with pytest.raises(ValueError, match="returned no spec"):
        register(Variant(Manifest("t-empty", "t", (P.RMSNORM,), uses_triton=True, kernels=lambda: []), _norm))
    with pytest.raises(ValueError, match="without the kernel spec interface"):
        register(Variant(Manifest("t-bad", "t", (P.RMSNORM,), uses_triton=True, kernels=lambda: [{"fn": 1}]), _norm))
    assert check_kernels(Variant(Manifest("t-torch", "t", (P.RMSNORM,)), _norm)) == []  # plain torch: none


def test_side_outputs_are_declared_for_a_kind_that_has_them_and_guarded():
    """Registration refuses a side output no replaced op kind has; the harness hands declared ones in guarded:
    a write past the tokens is caught by their guard region."""
    with pytest.raises(ValueError, match=r"declares side outputs \['tokens'\] that no op kind it replaces has"):
        register(Variant(Manifest("t-side", "t", (P.RMSNORM,), side_outputs=("tokens",)), _norm))
    base = get("triton-lm-head")

    def overrun(op, inputs, weights, outputs, cfg, step, cache=None):
        base.run(op, inputs, weights, outputs, cfg, step)
        t = outputs["tokens"]
        t.as_strided((t.numel() + 1,), (1,), t.storage_offset())[-1] = 0  # one element past the end

    v = Variant(Manifest("t-token-overrun", "t", (P.LM_HEAD,), base.manifest.scope, uses_triton=True,
                         kernels=base.manifest.kernels, side_outputs=("tokens", "logprobs")), overrun)
    _, _, fails = run_variant(v, build_case(QWEN, P.LM_HEAD, 3, 0, device=DEVICE))
    assert fails == ["output tokens: wrote outside its bounds (0 elements before it, 1 after it, in the guard regions "
                     "around its 3 elements)"], fails


def test_every_triton_variant_declares_every_path_it_runs():
    for v in all_variants():
        specs = check_kernels(v)
        assert bool(specs) == (v.manifest.uses_triton or v.kernel is not None), v.name
    paths = {(s.name, tuple(sorted(s.path_values().items()))) for s in check_kernels(get("triton-latent-moe"))}
    ups = {(dict(p)["GROUPED"], dict(p)["FAST"]) for n, p in paths if n == "grouped_up_kernel"}
    assert ups == {(False, False), (False, True), (True, False), (True, True)}  # per pair / grouped x exact / fast
    assert {dict(p)["NORM"] for n, p in paths if n == "linear_kernel"} == {False, True}  # latent down and up
    assert any(n == "experts_up_kernel" for n, _ in paths)  # the FMA kernels (<= 16 tokens, other scales)


def test_a_specialization_is_its_path_constexprs():
    spec = MUT.mutant_specs(MASK_OVERRUN=True)[0]
    assert "USE_ASM" not in spec.path and "MASK_OVERRUN" in spec.path  # device-driven flags are free
    assert spec.admits({f: f == "MASK_OVERRUN" for f in MUT.FLAGS} | {"USE_ASM": False})
    assert not spec.admits({f: False for f in MUT.FLAGS})
    ks = kernel_spec(harness_kernels.scale_kernel, {"x_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32"},
                     {"BLOCK": 128, "NC": False}, path=("BLOCK",))
    assert ks.admits({"BLOCK": 64}) and ks.admits({"BLOCK": 2}) and not ks.admits({"BLOCK": 1})  # 0, 1, 2+


def test_every_launch_is_recorded_and_checked_against_the_declaration():
    import triton.runtime.jit as jit

    before = jit.KernelInterface.__getitem__
    x, w, out = (torch.randn(3, 64, device=DEVICE), torch.randn(64, device=DEVICE),
                 torch.empty(3, 64, device=DEVICE))
    with record_launches() as launched:
        K_NORM.rms_norm_triton(x, w, 1e-6, out)
        MUT.rms_norm_mutant(x, w, 1e-6, out, POW2_MEAN=True)
    assert jit.KernelInterface.__getitem__ is before  # restored
    assert [k.rsplit(".", 1)[-1] for k, _ in launched] == ["rmsnorm_kernel", "rmsnorm_mutant_kernel"]
    assert launched[1][1]["POW2_MEAN"] is True and launched[0][1]["D"] == 64
    own = check_kernels(K_NORM.RMSNORM_VARIANT)
    msgs = undeclared(launched, own)
    assert len(msgs) == 1 and "rmsnorm_mutant_kernel" in msgs[0] and "does not declare" in msgs[0]
    msgs = undeclared(launched, own + MUT.mutant_specs(MASK_OVERRUN=True))
    assert len(msgs) == 1 and "a specialization its manifest does not declare" in msgs[0]
    assert undeclared(launched, own + MUT.mutant_specs(POW2_MEAN=True)) == []


# ---- the static audit ---------------------------------------------------------------------------------------------
def test_a_variant_defined_outside_the_catalog_is_audited():
    """Kernels of a test module, decorated for the interpreter here: compiled and audited in a fresh process."""
    clean, nc = audit_specs(harness_kernels.specs(False) + harness_kernels.specs(True))
    assert clean.passed and "nc-load-of-produced" in clean.rules_checked, clean.to_markdown()
    assert not nc.passed and {f.rule for f in nc.errors} >= {"nc-load-of-produced"}, nc.to_markdown()
    v = Variant(Manifest("t-outside", "t", (P.RMSNORM,), uses_triton=True,
                         kernels=lambda: harness_kernels.specs(True)), _norm)
    assert [r.passed for r in audit_variant(v)] == [False]


def test_a_kernel_that_does_not_compile_fails_its_audit():
    bad = kernel_spec(harness_kernels.scale_kernel, {"x_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32"},
                      {"BLOCK": 100, "NC": False})  # not a power of two: tl.arange refuses it
    (rep,) = audit_specs([bad])
    assert not rep.passed and rep.error and "ERROR" in rep.to_markdown()


def test_validate_audits_in_every_mode(capsys):
    """A renamed RMSNorm reading its input through ld.global.nc: every cell passes (the numbers are right), the
    audit of its declared kernel fails, in --quick, without --report."""
    code = main(["validate", "broken-rmsnorm-nc-load", "--quick", "--extra", "0", "--preset", "tiny-qwen3-moe"])
    out = capsys.readouterr().out
    assert code == 1
    assert "0 FAIL" in out and "audit FAIL rmsnorm_mutant_kernel" in out and "nc-load-of-produced" in out


def test_shipped_variants_audit_clean():
    """Every kernel path of every shipped variant, in one fresh process (~45 kernels; ~0.3 s each with Triton's
    cache warm)."""
    from megadecode.backends.fused.kernels.catalog import shipped

    specs = [s for v in shipped() for s in check_kernels(v)]
    reports = audit_specs(specs, unique=True)
    assert len(reports) >= 40 and all(r.passed for r in reports), [r.to_markdown() for r in reports if not r.passed]
    for v in shipped():  # each variant's audit now comes from the cache
        assert audit_variant(v) and all(r.passed for r in audit_variant(v))


# ---- outputs: poison, computed NaN, guards ------------------------------------------------------------------------
def test_poison_is_a_bit_pattern_not_any_nan():
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        t = poisoned((4, 5), dt, "cpu")
        assert unwritten(t) == 20 and nonfinite(t) == 0
        t[0, 0], t[0, 1], t[0, 2] = float("nan"), float("inf"), 1.0
        assert unwritten(t) == 17 and nonfinite(t) == 2
    t = poisoned((3,), torch.int64, "cpu")
    t[0] = 5
    assert unwritten(t) == 2 and nonfinite(t) == 0


def _variant(impl):
    return Variant(Manifest("t-probe", "t", (P.RMSNORM,)), impl)


def test_computed_nan_and_poison_left_have_distinct_messages():
    case = build_case(QWEN, P.RMSNORM, 3, 0)

    def nan_row(op, inputs, weights, outputs, cfg, step, cache=None):
        _norm(op, inputs, weights, outputs, cfg, step)
        outputs["normed"][1] = float("nan")

    def skip_row(op, inputs, weights, outputs, cfg, step, cache=None):
        _norm(op, {k: v[:2] for k, v in inputs.items()}, weights, {"normed": outputs["normed"][:2]}, cfg, step)

    _, _, f = run_variant(_variant(nan_row), case)
    assert len(f) == 1 and "64 of 192 elements non-finite (NaN/inf computed by the variant" in f[0]
    _, _, f = run_variant(_variant(skip_row), case)
    assert len(f) == 1 and "64 of 192 elements not written (poison left)" in f[0]
    _, _, f = run_variant(_variant(_norm), case)
    assert f == []


def test_guard_regions_catch_writes_outside_an_output():
    case = build_case(QWEN, P.RMSNORM, 3, 0)

    def past_end(op, inputs, weights, outputs, cfg, step, cache=None):
        _norm(op, inputs, weights, outputs, cfg, step)
        out = outputs["normed"]
        out.as_strided((out.numel() + 1,), (1,))[-1] = 0.0

    def before_start(op, inputs, weights, outputs, cfg, step, cache=None):
        _norm(op, inputs, weights, outputs, cfg, step)
        out = outputs["normed"]
        out.as_strided((1,), (1,), out.storage_offset() - 1)[0] = 0.0

    _, _, f = run_variant(_variant(past_end), case)
    assert f == ["output normed: wrote outside its bounds (0 elements before it, 1 after it, in the guard regions "
                 "around its 192 elements)"]
    _, _, f = run_variant(_variant(before_start), case)
    assert len(f) == 1 and "(1 elements before it, 0 after it" in f[0]


# ---- nothing ran is not a pass ------------------------------------------------------------------------------------
def test_a_matrix_of_skips_is_not_a_pass(capsys):
    rows = run_matrix(get("torch-attn-gqa"), presets=("tiny-deepseek-v3",), batches=(1, 3), dtypes=("float32",))
    assert {r["status"] for r in rows} == {"SKIP"} and verdict(rows) == "NOT RUN"
    assert verdict(rows + [{"status": "PASS"}]) == "PASS" and verdict([]) == "NOT RUN"
    assert main(["validate", "torch-attn-gqa", "--quick", "--preset", "tiny-deepseek-v3"]) == 1
    captured = capsys.readouterr()
    assert "0 PASS, 0 FAIL" in captured.out and "NOT RUN" in captured.err


def test_scope_limits_refuse_and_describe():
    v = Variant(Manifest("t-lim", "t", (P.RMSNORM,), scope=Scope(limits=(("hidden_size", 1, 32),))), _norm)
    assert v.supports(QWEN, torch.float32, 1, "cpu") == "hidden_size 64 outside 1..32"
    assert "hidden_size=1..32" in v.manifest.scope.describe()
