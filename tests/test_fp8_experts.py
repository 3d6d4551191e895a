"""The FP8 routed-experts kernels (megadecode/backends/fused/kernels/fp8_experts.py) under the Triton interpreter against the
torch reference (experts dequantized exactly, fp32 math), their registered variant in the harness, which
variants take FP8 experts, and the static sm_90 audit. Same interpreter arrangement as tests/test_grouped_experts.py
(the interpreter loads float8_e4m3fn tensors and converts them exactly, NaN codes aside)."""

from __future__ import annotations

import pytest
import torch

from interp import (  # noqa: E402, F401 (interpreter_env: an autouse fixture, imported to apply here)
    DEVICE, Recorder, import_interpreted, interpreter_env, static_audits, triton_gate,
)

F8 = import_interpreted("megadecode.backends.fused.kernels.fp8_experts", "megadecode.backends.fused.kernels.catalog", "megadecode.validate.catalog")

from megadecode.config import config_from_hf  # noqa: E402
from megadecode.presets import preset_config, preset_hf_config  # noqa: E402
from megadecode.quant.fp8 import FP8Tensor, quantize_fp8  # noqa: E402
from megadecode.reference.moe import experts_reference  # noqa: E402
from megadecode.validate.catalog import get  # noqa: E402
from megadecode.validate.matrix import run_matrix  # noqa: E402
from megadecode.validate.tolerances import FLOORS  # noqa: E402

TRITON_OK, needs_triton = triton_gate(F8.fp8_up_kernel)
# fp32 activations: wdtype fp32 is exact up to summation order; fp16 splits x and h into hi + lo parts (~22 bits)
TOL = {torch.float32: 2e-6, torch.float16: 2e-6}
# fp32 x on the GPU takes the up kernel's SPLIT path (x as bf16 hi + lo on tensor cores, ~16 bits per product): the
# harness's fp32 floor holds it (tolerances.FLOORS, 6.1e-5, what the triton-fp8-experts report states); measured on
# the H200 at 07a1134, 5.8e-6 of the largest output. On the CPU (interpreter, fp32 dots) the tighter 2e-6 holds
FP32_TOL = FLOORS["float32"].max_rel if DEVICE == "cuda" else 2e-6


def _fp8(w, block):
    q, s = quantize_fp8(w, block)
    return FP8Tensor(q.to(DEVICE), s.to(DEVICE), block)


def _problem(T, A=3, E=8, D=96, I=64, block=(32, 32), seed=0, ids=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g)
    if ids is None:
        ids = torch.stack([torch.randperm(E, generator=g)[:A] for _ in range(T)])
    w = torch.rand(T, A, generator=g) + 0.1
    gu = _fp8(torch.randn(E, 2 * I, D, generator=g) / D ** 0.5, block)
    dn = _fp8(torch.randn(E, D, I, generator=g) / I ** 0.5, block)
    return x.to(DEVICE), ids.to(DEVICE), w.to(DEVICE), gu, dn


def _close(got, ref, tol):
    got, ref = got.float(), ref.float()
    err = (got - ref).abs().max().item()
    assert torch.isfinite(got).all() and err <= tol * ref.abs().max().item(), (err, ref.abs().max().item())


def _reference(x, ids, w, gu, dn):
    return experts_reference(x, ids, w, gu, dn)  # FP8Tensor stacks: dequantized per expert, fp32


@needs_triton
@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T", [1, 3, 17])
def test_matches_the_dequantized_reference(grouped, wdtype, T):
    """D = 96 is not a multiple of the chunk: the last K chunk is masked (and a partial scale column)."""
    x, ids, w, gu, dn = _problem(T, seed=T)
    out = F8.fp8_experts(x, ids, w, gu, dn, grouped=grouped, wdtype=wdtype)
    _close(out, _reference(x, ids, w, gu, dn), TOL[wdtype])


@needs_triton
@pytest.mark.parametrize("block", [(128, 128), (64, 32), (32, 64)])
def test_block_shapes(block):
    """Scale rows and columns of other sizes than the chunks (128 x 128 as released: one scale column per
    D = 96 row, one scale row per 64 gate rows of one expert's I = 128)."""
    x, ids, w, gu, dn = _problem(5, I=128, block=block, seed=3)
    for grouped in (False, True):
        _close(F8.fp8_experts(x, ids, w, gu, dn, grouped=grouped), _reference(x, ids, w, gu, dn), FP32_TOL)


@needs_triton
def test_hot_expert_with_more_pairs_than_a_tile():
    """One expert picked by 20 tokens: its run spans two BLOCK_M chunks of pairs."""
    ids = torch.stack([torch.tensor([5, t % 4]) for t in range(20)])
    x, ids, w, gu, dn = _problem(20, A=2, ids=ids, seed=4)
    _close(F8.fp8_experts(x, ids, w, gu, dn, grouped=True), _reference(x, ids, w, gu, dn), FP32_TOL)


@needs_triton
def test_fp16_activations():
    x, ids, w, gu, dn = _problem(4, seed=5)
    out = F8.fp8_experts(x.half(), ids, w, gu, dn)
    assert out.dtype == torch.float16
    _close(out, _reference(x.half(), ids, w, gu, dn), 2e-3)


@needs_triton
def test_batch_invariant_and_deterministic():
    x, ids, w, gu, dn = _problem(6, seed=6)
    batch = F8.fp8_experts(x, ids, w, gu, dn, grouped=False)
    assert torch.equal(batch, F8.fp8_experts(x, ids, w, gu, dn, grouped=False))
    for t in (0, 5):
        assert torch.equal(F8.fp8_experts(x[t:t + 1], ids[t:t + 1], w[t:t + 1], gu, dn, grouped=False),
                           batch[t:t + 1])


@pytest.mark.parametrize("make, text", [
    (lambda gu, dn: (gu.dequantize(), dn), "must be an FP8Tensor"),
    (lambda gu, dn: (gu, FP8Tensor(*quantize_fp8(dn.dequantize().cpu(), (16, 32)), (16, 32))), "different blocks"),
    (lambda gu, dn: (FP8Tensor(*quantize_fp8(gu.dequantize().cpu(), (32, 48)), (32, 48)),
                     FP8Tensor(*quantize_fp8(dn.dequantize().cpu(), (32, 48)), (32, 48))), "power of two"),
    (lambda gu, dn: (FP8Tensor(*quantize_fp8(gu.dequantize().cpu(), (48, 32)), (48, 32)),
                     FP8Tensor(*quantize_fp8(dn.dequantize().cpu(), (48, 32)), (48, 32))), "not a multiple"),
])
def test_launcher_refuses_what_it_cannot_run(make, text):
    x, ids, w, gu, dn = _problem(2)
    gu, dn = make(gu, dn)
    with pytest.raises(ValueError, match=text):
        F8.fp8_experts(x, ids, w, gu, dn)


# ---- the variant ---------------------------------------------------------------------------------------

def test_which_variants_take_fp8_experts():
    fp8, plain = preset_config("tiny-qwen3-moe-fp8"), preset_config("tiny-qwen3-moe")
    v = get("triton-fp8-experts")
    assert v.supports(fp8, torch.float32, 3, DEVICE) is None
    assert "not FP8" in v.supports(plain, torch.float32, 3, DEVICE)
    for name in ("triton-grouped-experts", "triton-fused-experts", "torch-grouped-experts", "torch-loop-experts"):
        assert "FP8 experts" in get(name).supports(fp8, torch.float32, 3, DEVICE), name
        assert get(name).supports(plain, torch.float32, 3, DEVICE) is None, name
    odd = config_from_hf({**preset_hf_config("tiny-qwen3-moe-fp8"), "quantization_config": {
        "quant_method": "fp8", "weight_block_size": [32, 24]}})
    assert "power of two" in v.supports(odd, torch.float32, 3, DEVICE)


@needs_triton
def test_variant_passes_the_quick_matrix_on_the_fp8_presets():
    """The harness adds the FP8 presets for this variant (matrix.EXPERT_PRESETS): every cell there passes; the
    float presets of its families are out of scope (SKIP, saying why)."""
    rows = run_matrix(get("triton-fp8-experts"), batches=(1, 17), dtypes=("float32",),
                      dists=("uniform", "hot_expert"), device=DEVICE)
    by = {s: {r["preset"] for r in rows if r["status"] == s} for s in ("PASS", "SKIP", "FAIL")}
    assert by == {"PASS": {"tiny-qwen3-moe-fp8", "tiny-deepseek-v3-fp8"},
                  "SKIP": {"tiny-qwen3-moe", "tiny-deepseek-v3"}, "FAIL": set()}, by
    assert all("not FP8" in r["reason"] for r in rows if r["status"] == "SKIP")


def test_static_audit_sm90_all_kernels():
    rows = static_audits(("megadecode.backends.fused.kernels.fp8_experts", [{"dtype": "bf16"}, {"dtype": "fp32", "grouped": False}]))
    assert [r[0] for r in rows] == ["fp8_up_kernel", "fp8_down_kernel", "combine_kernel"] * 2


def test_the_launcher_takes_a_gpus_tuned_blocks_and_explicit_blocks_win(tmp_path, monkeypatch):
    """`megadecode tune --kernel fp8-experts` writes configs/fp8-experts/<gpu>.json keyed by tuned_key (the shape,
    the weights' block and the per-pair / grouped split); fp8_experts reads the entry for its batch on that GPU,
    and blocks passed by the caller are used as given."""
    from megadecode.backends.fused.kernels import tuning

    monkeypatch.setattr(tuning, "CONFIG_DIR", tmp_path)
    tuning.clear_cache()
    up, down, comb = Recorder(), Recorder(), Recorder()
    monkeypatch.setattr(F8, "fp8_up_kernel", up)
    monkeypatch.setattr(F8, "fp8_down_kernel", down)
    monkeypatch.setattr(F8, "combine_kernel", comb)
    monkeypatch.setattr(F8, "_device_name", lambda device: "Fake GPU 80GB")
    x, ids, w, gu, dn = _problem(3, D=256, I=128, block=(128, 128))
    key = F8.tuned_key(256, 128, 3, (128, 128), grouped=False)
    assert key == F8.tuning_key(256, 128, 3, "fp8", "silu", 3)
    data = tuning.merge(None, F8.KERNEL, "Fake GPU 80GB", key, 4, {"BLOCK_I": 16, "BLOCK_N": 32, "BLOCK_D": 64,
                                                                  "num_stages": 2},
                        {"ms": 1.0, "mbu": 0.5, "command": "t", "date": "d"})
    tuning.write(tuning.config_path(F8.KERNEL, "Fake GPU 80GB"), data)
    try:
        F8.fp8_experts(x, ids, w, gu, dn)
        (g_up, kw_up), = up.launches
        (g_dn, kw_dn), = down.launches
        assert (kw_up["BLOCK_I"], kw_up["BLOCK_D"], kw_up["num_stages"], g_up) == (16, 64, 2, (9, 128 // 16))
        assert (kw_dn["BLOCK_N"], kw_dn["num_stages"], g_dn) == (32, 2, (9, 256 // 32))
        F8.fp8_experts(x, ids, w, gu, dn, blocks={"BLOCK_I": 32})
        assert up.launches[1][1]["BLOCK_I"] == 32 and up.launches[1][1]["num_stages"] == F8.DEFAULT_BLOCKS["num_stages"]
    finally:
        tuning.clear_cache()
    with pytest.raises(ValueError, match="fp8-experts tunes FP8 weights with silu"):
        F8.tuning_key(256, 128, 3, "bf16", "silu", 1)
