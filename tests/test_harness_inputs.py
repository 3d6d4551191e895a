"""Inputs that leave the easy corner (issue 12): every op kind has an input builder (and a variant of it can be
validated), the extra cases really have non-power-of-two dims, caches spanning several split chunks, permuted
slots and rows of tiny or large magnitude, and their sample is seeded and reported."""

from __future__ import annotations

import pytest
import torch

from interp import DEVICE, import_interpreted, interpreter_env  # noqa: F401 (autouse fixture)

import_interpreted("megadecode.validate.catalog")

from megadecode import plan as P  # noqa: E402
from megadecode.contract import Manifest, Scope, Variant  # noqa: E402
from megadecode.backends.torch.ops import OP_IMPLS, StepContext  # noqa: E402
from megadecode.backends.fused.kernels.splitk import split_plan  # noqa: E402
from megadecode.presets import preset_config  # noqa: E402
from megadecode.validate import cases as C  # noqa: E402
from megadecode.validate.catalog import get  # noqa: E402
from megadecode.validate.checks import check_op  # noqa: E402
from megadecode.validate.inputs import BUILDERS, CACHE_LEN, build_case  # noqa: E402
from megadecode.validate.matrix import QUICK_BATCHES, case_plan, run_matrix  # noqa: E402

PRESETS = ("tiny-qwen3-moe", "tiny-deepseek-v3", "tiny-kimi-linear", "tiny-k3")


def _preset_with(kind: str) -> str:
    for p in PRESETS:
        if any(op.kind == kind for op in P.fuse_add_rmsnorm(P.build_plan(preset_config(p))).ops + P.build_plan(
                preset_config(p)).ops):
            return p
    raise AssertionError(f"no tiny preset has a {kind} op")


def _reference_variant(kind: str) -> Variant:
    """The torch reference op itself as a variant (in whatever dtype it is given)."""
    def run(op, inputs, weights, outputs, cfg, step, cache=None):
        ctx = StepContext(cfg, weights, {op.cache: cache} if op.cache else {}, step)
        ctx.buf.update(inputs)
        OP_IMPLS[op.kind](ctx, op)
        for n, t in outputs.items():
            t.copy_(ctx.buf[n])
    fams = ("qwen3_moe", "deepseek_v3", "kimi_linear", "kimi_k3")
    # the reference's routed experts loop over the experts that received tokens (host syncs): not capturable in a
    # CUDA graph, as torch-loop-experts declares; the GPU's graph-replay check skips what does not claim it
    capturable = kind not in (P.EXPERTS, P.LATENT_MOE)
    return Variant(Manifest(f"reference-{kind}", "the reference op", (kind,), Scope(families=fams),
                            graph_capturable=capturable), run)


@pytest.mark.parametrize("kind", P.OP_KINDS)
def test_every_op_kind_has_a_builder_and_can_be_validated(kind):
    assert kind in BUILDERS
    cfg = preset_config(_preset_with(kind))
    v = _reference_variant(kind)
    for dtype in ("float32", "float16", "bfloat16"):
        row = check_op(v, cfg, kind, dtype, 3, seed=1, device=DEVICE)
        assert row["status"] == "PASS", row


@pytest.mark.parametrize("name", ["torch-embed", "torch-add", "torch-mlp", "torch-attn-res"])
def test_torch_restatements_of_the_new_kinds_pass_with_every_extra_case(name):
    rows = run_matrix(get(name), batches=QUICK_BATCHES, dtypes=("float32", "float16", "bfloat16"), extra=None,
                      device=DEVICE)
    assert rows and all(r["status"] == "PASS" for r in rows), [r for r in rows if r["status"] != "PASS"][:3]
    assert {r["case"] for r in rows} > {"base"}


def test_odd_dims_are_not_powers_of_two_and_keep_the_kernels_constraints():
    pow2 = lambda n: n & (n - 1) == 0  # noqa: E731
    for p in PRESETS:
        base, odd = preset_config(p), C.odd_config(preset_config(p))
        assert odd is not None and odd.family == base.family
        assert not pow2(odd.hidden_size) and not pow2(odd.num_experts) and not pow2(odd.moe_intermediate_size)
        assert not pow2(odd.kv_lora_rank if odd.is_mla else odd.head_dim)
        if odd.expert_quant == "mxfp4":
            assert odd.latent_size % 32 == 0 and odd.moe_intermediate_size % 32 == 0  # MXFP4 blocks of 32
        case = build_case(odd, P.RMSNORM, 3, 0)
        assert case.inputs[case.op.inputs[0]].shape == (3, 80)


def test_long_cache_cases_make_the_split_merge_run():
    """The base cache (16 positions) fits one 32-position block: one chunk, no merge. The long cache is cut in
    several chunks on the CPU too (its split plan assumes 2 SMs: splits = 4 / programs): GQA at batch 1 (2 kv
    heads), MLA at batches 1 and 2 (one head block)."""
    for kind, preset, programs, names in (
            (P.ATTN_GQA, "tiny-qwen3-moe", 2, ("long-cache b1", "slots+long-cache b1")),
            (P.ATTN_MLA, "tiny-deepseek-v3", 1, ("long-cache b1", "long-cache b2", "slots+long-cache b1"))):
        cfg = preset_config(preset)
        cands = {c.name: c for c in C.candidates(get("triton-mla-decode" if kind == P.ATTN_MLA else
                                                     "triton-gqa-decode"), cfg, kind, DEVICE)}
        for name in names:
            c = cands[name]
            case = build_case(c.cfg, kind, c.batch, 0, **c.build_kwargs())
            assert case.step.kv_len == C.LONG_CACHE
            assert split_plan(programs * c.batch, case.step.kv_len, 32, torch.device("cpu"))[0] >= 2
        base = build_case(cfg, kind, 1, 0)
        assert base.step.kv_len == CACHE_LEN and split_plan(programs, base.step.kv_len, 32, torch.device("cpu"))[0] == 1


def test_permuted_slots_case_uses_slot_indirection():
    case = build_case(preset_config("tiny-qwen3-moe"), P.ATTN_GQA, 8, 0, slots="permuted")
    assert not case.step.contiguous_slots and case.cache[0].shape[0] == 8 + 3
    assert not torch.equal(case.step.slots, torch.arange(8)) and case.step.slots.unique().numel() == 8
    assert torch.equal(case.inputs["slots"], case.step.slots)
    row = check_op(get("torch-attn-gqa"), preset_config("tiny-qwen3-moe"), P.ATTN_GQA, "float32", 8, 0,
                   slots="permuted", device=DEVICE)
    assert row["status"] == "PASS" and row["slots"] == "permuted", row


def test_magnitude_cases_scale_every_third_row():
    cfg = preset_config("tiny-qwen3-moe")
    base = build_case(cfg, P.RMSNORM, 7, 0).inputs["hidden"]
    tiny = build_case(cfg, P.RMSNORM, 7, 0, magnitude="tiny").inputs["hidden"]
    large = build_case(cfg, P.ADD, 7, 0, magnitude="large").inputs["hidden"]
    norms = tiny.norm(dim=1) / base.norm(dim=1)
    assert torch.allclose(norms[0::3], torch.full((3,), 1e-3)) and torch.allclose(norms[1::3], torch.ones(2))
    assert large[1::3].abs().max() > 4000 and large[0::3].abs().max() < 20
    with pytest.raises(ValueError, match="magnitude must be"):
        build_case(cfg, P.RMSNORM, 7, 0, magnitude="huge")


def test_kda_magnitude_cases_scale_the_token_and_its_slot_histories():
    """KDA's l2norm sees q and k built from this token's activation and the conv state, its gated norm the readout
    of the recurrent state: a magnitude case scales all three for every third token, at that token's slot."""
    cfg = preset_config("tiny-kimi-linear")
    base = build_case(cfg, P.ATTN_KDA, 7, 0, slots="permuted")
    tiny = build_case(cfg, P.ATTN_KDA, 7, 0, slots="permuted", magnitude="tiny")
    large = build_case(cfg, P.ATTN_KDA, 7, 0, slots="permuted", magnitude="large")
    assert torch.equal(tiny.step.slots, base.step.slots)
    rows, others = torch.tensor([0, 3, 6]), torch.tensor([1, 2, 4, 5])
    for part, case, scale, at in ((0, tiny, 1e-3, rows), (1, tiny, 1e-3, rows), (0, large, 4096.0, rows[:2] + 1)):
        slots = case.step.slots[at]
        torch.testing.assert_close(case.cache[part][slots], base.cache[part][slots] * scale)
        torch.testing.assert_close(case.inputs["normed"][at], base.inputs["normed"][at] * scale)
    torch.testing.assert_close(tiny.cache[0][tiny.step.slots[others]], base.cache[0][base.step.slots[others]])
    assert P.ATTN_KDA in {k for k in BUILDERS} and "magnitude-tiny b7" in {
        c.name for c in C.candidates(get("triton-kda-decode"), cfg, P.ATTN_KDA, DEVICE)}


def test_attn_res_sources_cases_leave_the_power_of_two_corner():
    """The tiny K3 preset's AttnRes op has 2 sources; the sources cases run ops over 3, 5 and 7 (K3's ops have 1 to
    8), each the block-closing op of a deeper config, with that many source rows reaching the softmax."""
    from megadecode.validate.inputs import attn_res_sources, first_op, reference_outputs

    cfg = preset_config("tiny-k3")
    assert attn_res_sources(cfg, first_op(cfg, P.ATTN_RES)) == 2
    cases = [c for c in C.candidates(get("triton-attn-res"), cfg, P.ATTN_RES, DEVICE) if c.family == "sources"]
    assert [c.sources for c in cases] == [3, 5, 7] and [c.name for c in cases][0] == "sources-3 b3"
    for c in cases:
        case = build_case(c.cfg, P.ATTN_RES, c.batch, 0, **c.build_kwargs())
        assert case.op.layer == c.sources * cfg.attn_res_block_size and "blocks" in case.op.outputs
        assert case.inputs["blocks"].shape == (c.sources - 1, 3, cfg.hidden_size)
        assert reference_outputs(case)[0]["blocks"].shape[0] == c.sources  # the closed blocks: every source
    with pytest.raises(ValueError, match="over 4 sources"):
        build_case(cfg, P.ATTN_RES, 3, 0, sources=4)  # the 5-layer preset has no such op


def test_candidates_follow_the_scope():
    cfg = preset_config("tiny-deepseek-v3")
    router = {c.name: c for c in C.candidates(get("triton-router"), cfg, P.ROUTER, DEVICE)}
    edge = router["edge num_experts=1024,n_group=16 b2"].cfg
    assert (edge.num_experts, edge.n_group) == (1024, 16)  # Scope.limits' upper bounds, at once
    norm = {c.name: c for c in C.candidates(get("triton-rmsnorm"), cfg, P.RMSNORM, DEVICE)}
    assert norm["edge hidden_size=16384 b2"].cfg.hidden_size == 16384 and "magnitude-large b7" in norm
    fused = C.candidates(get("triton-fused-experts"), cfg, P.EXPERTS, DEVICE)  # scope batch 1..16
    assert fused and max(c.batch for c in fused) <= 16
    assert max(c.batch for c in C.candidates(get("triton-grouped-experts"), cfg, P.EXPERTS, DEVICE, 65)) == 65


def test_the_sample_is_seeded_reported_and_differs_per_op():
    v, cfg = get("triton-rmsnorm"), preset_config("tiny-qwen3-moe")
    cands = C.candidates(v, cfg, P.RMSNORM, DEVICE)
    k = len(C.families(cands)) + 2  # one case per family, and two drawn
    a, b = C.sample(cands, k, 0, "x"), C.sample(cands, k, 0, "x")
    assert [c.name for c in a] == [c.name for c in b] and len(a) == k
    assert any([c.name for c in C.sample(cands, k, s, "x")] != [c.name for c in a] for s in range(1, 6))
    plan = case_plan(v, presets=("tiny-qwen3-moe",), extra=k, case_seed=0, device=DEVICE)
    picked = C.sample(cands, k, 0, "tiny-qwen3-moe/rmsnorm")
    assert plan == {"tiny-qwen3-moe/rmsnorm": {"cases": [c.name for c in picked], "of": len(cands),
                                               "families": C.families(cands)}}
    rows = run_matrix(v, presets=("tiny-qwen3-moe",), batches=(), dtypes=("float32",), extra=k, case_seed=0,
                      device=DEVICE)
    assert [r["case"] for r in rows] == plan["tiny-qwen3-moe/rmsnorm"]["cases"]
    assert [r["case_family"] for r in rows] == [c.family for c in picked]


@pytest.mark.parametrize("name,preset,kind", [("triton-rmsnorm", "tiny-qwen3-moe", P.RMSNORM),
                                              ("triton-gqa-decode", "tiny-qwen3-moe", P.ATTN_GQA),
                                              ("triton-mla-decode", "tiny-deepseek-v3", P.ATTN_MLA)])
def test_every_sample_covers_every_family_with_its_first_case(name, preset, kind):
    """A quick run never leaves a family out: for every seed and k, each family's first candidate is drawn (so a
    bug only one family shows is caught by every quick run), and the sample is k long when k covers the families."""
    cands = C.candidates(get(name), preset_config(preset), kind, DEVICE, 65)
    fams = C.families(cands)
    assert {"odd-dims", "tile-edge"} <= set(fams) and len(fams) >= 4
    firsts = [next(c.name for c in cands if c.family == f) for f in fams]
    for seed in range(200):
        for k in (1, 4, len(fams) + 1):
            picked = C.sample(cands, k, seed, f"{preset}/{kind}")
            assert C.families(picked) == fams, (seed, k)
            assert set(firsts) <= {c.name for c in picked}, (seed, k)
            assert len(picked) == max(k, len(fams))


def test_the_quick_command_prints_the_families_it_ran():
    from megadecode.validate.matrix import plan_lines

    plan = case_plan(get("triton-gqa-decode"), presets=("tiny-qwen3-moe",), extra=1, case_seed=3, device=DEVICE,
                     extra_max_batch=65)
    (line,) = plan_lines(plan, 3)
    assert line.startswith("extra cases tiny-qwen3-moe/attn_gqa (seed 3): odd-dims b3, tile-edge b17, long-cache b1, "
                           "slots b3 (of 9); families: odd-dims, tile-edge, long-cache, slots"), line
