"""The validation harness (megadecode/validate): every deliberately broken variant is flagged, no correct
variant is, the executor enforces manifests, the end-to-end comparison and the CLI work.

Triton variants run on the CPU under the Triton interpreter: TRITON_INTERPRET=1 must be set when triton
and the kernel modules are first imported (their @jit functions are decorated then) and while they run;
tests/conftest.py sets it for the whole suite when there is no GPU.
"""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

from interp import (  # noqa: E402, F401 (interpreter_env: an autouse fixture, imported to apply here)
    ON_GPU, DEVICE, import_interpreted, interpreter_env, triton_gate,
)

router_kernel = import_interpreted("megadecode.backends.fused.kernels.router", "megadecode.validate.catalog").router_kernel

from megadecode import plan as P  # noqa: E402
from megadecode.cli import main  # noqa: E402
from megadecode.engine import Engine  # noqa: E402
from megadecode.backends.torch.ops import OP_IMPLS, StepContext  # noqa: E402
from megadecode.presets import preset_config  # noqa: E402
from megadecode.step import Step  # noqa: E402
from megadecode.validate.e2e import compare_generation  # noqa: E402
from megadecode.validate.executor import VariantExecutor, checksum  # noqa: E402
from megadecode.validate.matrix import QUICK_BATCHES, run_matrix  # noqa: E402
from megadecode.contract import output_specs  # noqa: E402
from megadecode.contract import Manifest, ManifestViolation, Scope, Variant  # noqa: E402
from megadecode.validate.catalog import all_variants, get  # noqa: E402
from megadecode.weights import random_weights  # noqa: E402

TRITON_OK, needs_triton = triton_gate(router_kernel)
PRESETS = ("tiny-qwen3-moe", "tiny-deepseek-v3")
CORRECT = ("triton-router", "triton-rmsnorm", "torch-grouped-experts", "torch-loop-experts", "torch-attn-gqa")
USES_TRITON = {v.name for v in all_variants() if v.manifest.uses_triton}



def _failures(rows):
    return [(r["preset"], r["batch"], r["dtype"], r["dist"], r["seed"], r["failures"]) for r in rows
            if r["status"] == "FAIL"]


# ---- registry and manifests ---------------------------------------------------------------------
def test_registry_lists_correct_and_broken_variants():
    names = {v.name for v in all_variants()}
    assert set(CORRECT) <= names
    assert {n for n in names if n.startswith("broken-")} == {
        "broken-router-tie-high", "broken-router-no-renorm", "broken-router-renorm-after-scale",
        "broken-router-noise", "broken-rmsnorm-last-row", "broken-rmsnorm-batch67",
        "broken-rmsnorm-scratch-input", "broken-experts-offsets", "broken-attn-stale-cache",
        # one per gap of issue 12 (tests/test_broken_zoo.py)
        "broken-rmsnorm-mask-overrun", "broken-rmsnorm-pow2-mean", "broken-rmsnorm-sumsq16",
        "broken-rmsnorm-eps-outside", "broken-rmsnorm-eps-sign", "broken-rmsnorm-nc-load",
        "broken-router-undeclared-path", "broken-mla-merge", "broken-attn-arange-slots", "broken-experts-scale",
        "broken-mlp-gelu", "broken-experts-atomic",
        # one per blind spot of issue 39 (tests/test_broken_zoo.py)
        "broken-kda-eps-outside", "broken-attn-res-pad-zero", "broken-lm-head-logprob-shift",
        "broken-lm-head-scratch-mask"}
    with pytest.raises(ValueError, match="unknown variant"):
        get("no-such-variant")
    for v in all_variants():
        assert v.manifest.replaces and set(v.manifest.replaces) <= set(P.OP_KINDS)
        assert all(os.path.isfile(s) for s in v.manifest.sources), v.manifest.sources


def test_supports_gives_reasons():
    qwen, ds = preset_config("tiny-qwen3-moe"), preset_config("tiny-deepseek-v3")
    attn = get("torch-attn-gqa")
    assert attn.supports(qwen, torch.float32, 8, "cpu") is None
    assert "family deepseek_v3" in attn.supports(ds, torch.float32, 8, "cpu")
    assert "float16" in get("torch-grouped-experts").supports(qwen, torch.float16, 8, "cpu")
    narrow = Variant(Manifest("t", "t", (P.ROUTER,), Scope(batch=(1, 64), devices=("cuda",), arch="sm_90",
                                                           dims=lambda c: "too many experts")), None)
    assert "batch 65" in narrow.supports(qwen, torch.float32, 65, "cuda")
    assert "device cpu" in narrow.supports(qwen, torch.float32, 1, "cpu")
    dims_only = Variant(Manifest("t", "t", (P.ROUTER,), Scope(dims=lambda c: "too many experts")), None)
    assert dims_only.supports(qwen, torch.float32, 1, "cpu") == "too many experts"
    if not ON_GPU and TRITON_OK:
        assert "interpreter" in get("triton-router").supports(qwen, torch.bfloat16, 1, "cpu")


def test_output_specs_match_the_reference_ops():
    for preset in PRESETS:
        cfg = preset_config(preset)
        w = random_weights(cfg)
        eng = Engine(cfg, w, max_batch=3, max_seq_len=8)
        step = Step(tokens=torch.tensor([5, 6, 7]), positions=torch.tensor([0, 1, 2]), slots=torch.arange(3),
                    logit_rows=torch.tensor([0, 2]), kv_len=3)
        ctx = StepContext(cfg, w, eng.cache, step)
        for op in eng.plan.ops:
            specs = output_specs(cfg, op, ctx.buf, w)
            OP_IMPLS[op.kind](ctx, op)
            for n, (shape, dt) in specs.items():
                assert (tuple(ctx.buf[n].shape), ctx.buf[n].dtype) == (shape, dt), (op.name, n)


def test_checksum_sees_any_change():
    t = torch.randn(1000)
    s = checksum(t)
    assert checksum(t.clone()) == s
    t2 = t.clone()
    t2[[3, 4]] = t2[[4, 3]]  # a swap keeps every plain sum
    assert checksum(t2) != s
    # a swap of two values whose bytes sum alike (1.0 is 00 00 80 3f, this one 3f 80 00 00): the position-linear sum
    # alone kept it (the swap above hit such a pair in about 1 run in 300)
    t2 = t.clone()
    t2[3], t2[4] = 1.0, torch.tensor([0x0000803F], dtype=torch.int32).view(torch.float32)[0]
    s2 = checksum(t2)
    t2[[3, 4]] = t2[[4, 3]]
    assert checksum(t2)[0] == s2[0] and checksum(t2) != s2
    t2 = t.clone()
    t2[999] = torch.nextafter(t2[999], torch.tensor(10.0))
    assert checksum(t2) != s


# ---- correct variants pass, broken ones are flagged ---------------------------------------------
@pytest.mark.parametrize("name", CORRECT)
def test_correct_variant_passes_ci_matrix(name):
    v = get(name)
    rows = run_matrix(v, batches=QUICK_BATCHES, dtypes=("float32", "float16"), seeds=(0, 1), device=DEVICE)
    assert not _failures(rows)
    assert sum(r["status"] == "PASS" for r in rows) >= len(rows) // 2


# name -> (matrix arguments that catch it, text every failure contains)
BROKEN_CAUGHT_BY = {
    "broken-router-tie-high": ({"dists": ("exact_ties",)}, "topk_ids"),
    "broken-router-no-renorm": ({"dists": ("uniform",)}, "topk_weights"),
    "broken-router-renorm-after-scale": ({"dists": ("uniform",), "presets": ("tiny-deepseek-v3",)}, "topk_weights"),
    # (on a GPU the graph-replay check, which runs first, sees the same nondeterminism)
    "broken-router-noise": ({"dists": ("uniform",)}, ("not deterministic", "graph replay on fresh inputs differs")),
    "broken-rmsnorm-last-row": ({}, "not written"),
    "broken-rmsnorm-batch67": ({}, "normed"),
    "broken-rmsnorm-scratch-input": ({}, "input hidden modified"),
    "broken-experts-offsets": ({"dists": ("uniform", "hot_expert")}, "moe_out"),
    "broken-attn-stale-cache": ({"presets": ("tiny-qwen3-moe",)}, "cache[0]"),
}


@pytest.mark.parametrize("name", sorted(BROKEN_CAUGHT_BY))
def test_broken_variant_is_flagged(name):
    v = get(name)
    kw, text = BROKEN_CAUGHT_BY[name]
    kw = {"presets": PRESETS, "dtypes": ("float32",), **kw}
    for seed in (0, 1):  # flagged on every repetition, not by luck
        fails = _failures(run_matrix(v, batches=QUICK_BATCHES, seeds=(seed,), device=DEVICE, **kw))
        assert fails, f"{name} passed seed {seed}"
        texts = (text,) if isinstance(text, str) else text
        assert all(any(t in m for t in texts for m in f[-1]) for f in fails), fails
        if name == "broken-rmsnorm-batch67":
            assert {f[1] for f in fails} == {67}  # only the batch sweep's 67 shows it


def test_renorm_after_scale_is_invisible_when_the_scale_is_one():
    """A limit worth knowing: with routed_scaling_factor 1 (Qwen3) the bug computes the right function."""
    rows = run_matrix(get("broken-router-renorm-after-scale"), presets=("tiny-qwen3-moe",), batches=(3,),
                      dtypes=("float32",), dists=("uniform",), device=DEVICE)
    assert [r["status"] for r in rows] == ["PASS"]


def test_skip_rows_carry_the_manifest_reason():
    rows = run_matrix(get("torch-attn-gqa"), presets=("tiny-deepseek-v3",), batches=(1,), dtypes=("float32",))
    assert [r["status"] for r in rows] == ["SKIP"] and "family deepseek_v3" in rows[0]["reason"]


def test_exact_ties_cross_the_topk_boundary():
    """The tie distribution is only useful if ties decide picks: picking by the lowest index must differ
    from picking by the highest index for some token (else broken-router-tie-high could pass)."""
    from megadecode.reference.routing import route
    from megadecode.validate.inputs import build_case, reference_outputs

    for preset in PRESETS:
        cfg = preset_config(preset)
        c = build_case(cfg, P.ROUTER, 8, 0, "exact_ties")
        low = reference_outputs(c)[0]["topk_ids"].sort(-1).values
        ws = [c.weights[n].flip(0) for n in c.op.weights]
        high = (cfg.num_experts - 1 - route(cfg, c.inputs["normed"], ws[0], ws[1] if len(ws) > 1 else None)[0])
        assert (low != high.sort(-1).values).any(-1).sum() >= 1


# ---- executor: variants in the plan, manifests enforced ----------------------------------------
def _decode_logits(executor_variants, preset="tiny-qwen3-moe", enforce=True):
    cfg = preset_config(preset)
    w = random_weights(cfg, DEVICE, seed=3)
    eng = Engine(cfg, w, max_batch=3, max_seq_len=16)
    if executor_variants is not None:
        eng.executor = VariantExecutor(eng.plan, w, eng.cache, executor_variants, enforce=enforce)
    eng.prefill([[256, 1, 2], [256, 9], [256, 4, 5, 6]])
    return eng.decode(torch.tensor([7, 8, 9], device=DEVICE)), eng.executor


@needs_triton
@pytest.mark.parametrize("preset", PRESETS)
def test_variant_executor_matches_torch(preset):
    vs = [get(n) for n in CORRECT]
    ref, _ = _decode_logits(None, preset)
    got, ex = _decode_logits(vs, preset)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    expected = {"triton-router", "triton-rmsnorm", "torch-grouped-experts"} | (
        {"torch-attn-gqa"} if preset == "tiny-qwen3-moe" else set())
    assert set(ex.ran) == expected  # first matching variant per kind; attention falls back on MLA


@needs_triton
@pytest.mark.parametrize("name,text", [("broken-rmsnorm-scratch-input", "modified buffer hidden"),
                                       ("broken-rmsnorm-last-row", "left outputs unwritten: normed")])
def test_executor_rejects_manifest_violations(name, text):
    with pytest.raises(ManifestViolation, match=text):
        _decode_logits([get(name)])


def test_executor_rejects_writes_to_weights_and_other_caches():
    def write_weight(op, inputs, weights, outputs, cfg, step, cache=None):
        get("torch-loop-experts").run(op, inputs, weights, outputs, cfg, step)
        weights[op.weights[1]][0, 0, 0] += 1.0

    def write_other_cache(op, inputs, weights, outputs, cfg, step, cache=None):
        get("torch-attn-gqa").run(op, inputs, weights, outputs, cfg, step, cache)
        other = f"cache.{(op.layer + 1) % cfg.num_layers}"
        eng_cache[other][0][0, 0, 0, 0] = 123.0

    m = Manifest("test-bad", "writes what it does not own", (P.EXPERTS,))
    with pytest.raises(ManifestViolation, match="modified weight model.layers.0.mlp.experts.down_proj"):
        _decode_logits([Variant(m, write_weight)])
    cfg = preset_config("tiny-qwen3-moe")
    w = random_weights(cfg)
    eng = Engine(cfg, w, max_batch=1, max_seq_len=8)
    eng_cache = eng.cache
    eng.executor = VariantExecutor(eng.plan, w, eng.cache, [Variant(Manifest("t", "t", (P.ATTN_GQA,)),
                                                                    write_other_cache)])
    with pytest.raises(ManifestViolation, match=r"modified cache\.1\[0\]"):
        eng.prefill([[256, 1]])


def test_executor_logs_fallback_once(caplog):
    with caplog.at_level(logging.INFO, logger="megadecode.validate.executor"):
        _, ex = _decode_logits([get("torch-attn-gqa")], "tiny-deepseek-v3")
    assert not ex.ran and not caplog.records  # MLA attention is not a kind it replaces: plain reference
    narrow = Variant(Manifest("t-narrow", "t", (P.EXPERTS,), Scope(batch=(64, 128))), None)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="megadecode.validate.executor"):
        _, ex = _decode_logits([narrow])  # 2 MoE layers x (prefill of 9 tokens + decode of 3)
    msgs = [r.getMessage() for r in caplog.records if "t-narrow" in r.getMessage()]
    assert not ex.ran and len(msgs) == 2  # once per reason, not once per op
    assert "batch 9 outside 64..128" in msgs[0] and "batch 3 outside 64..128" in msgs[1]


# ---- end to end ---------------------------------------------------------------------------------
@needs_triton
@pytest.mark.parametrize("preset", PRESETS)
def test_e2e_correct_variants_agree_for_128_steps(preset):
    names = ["triton-router", "triton-rmsnorm", "torch-grouped-experts", "torch-attn-gqa"]
    prompts = ([256, 72, 101, 108, 108, 111], [256, 1, 2, 3], [256, 40])
    res = compare_generation([get(n) for n in names], preset, prompts=prompts, steps=128, device=DEVICE)
    assert res["status"] == "PASS" and res["divergences"] == [], res
    assert res["variant_ops_run"]["triton-router"] >= 128 * sum(preset_config(preset).moe_layers)


def test_e2e_reports_the_first_divergence():
    res = compare_generation([get("broken-attn-stale-cache")], "tiny-qwen3-moe", steps=32, device=DEVICE)
    assert res["status"] == "FAIL" and res["divergences"]
    d = res["divergences"][0]
    assert set(d) == {"sequence", "step", "ref_token", "variant_token", "variant_token_in_ref_top5",
                      "ref_token_in_variant_top5", "logprob_gap", "near_tie"}
    assert d["ref_token"] != d["variant_token"] and d["logprob_gap"] > 0


# ---- CLI ----------------------------------------------------------------------------------------
def test_cli_list(capsys):
    assert main(["validate", "--list"]) == 0
    out = capsys.readouterr().out
    assert all(n in out for n in CORRECT) and "broken-rmsnorm-batch67" in out and "scope:" in out


@needs_triton
def test_cli_quick_fails_on_a_broken_variant(capsys, tmp_path):
    out = tmp_path / "rows.json"
    assert main(["validate", "broken-rmsnorm-batch67", "--quick", "--json", str(out)]) == 1
    text = capsys.readouterr().out
    assert "FAIL" in text and "batch 67" in text
    doc = json.loads(out.read_text())
    assert doc["variant"]["name"] == "broken-rmsnorm-batch67" and doc["counts"]["FAIL"] > 0
    assert {r["batch"] for r in doc["rows"] if r["status"] == "FAIL"} == {67}


def test_cli_quick_passes_a_correct_variant(capsys):
    assert main(["validate", "torch-loop-experts", "--quick"]) == 0
    assert "0 FAIL" in capsys.readouterr().out

