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


# FP8_X: x as two e4m3 planes with power-of-two scales per scale column (fp8_x_kernel): ~8 significant bits per
# element against its group's max, 2**-9 of the max measured on the interpreter (bound asserted: 2**-8); through
# the experts, 0.8-1.1e-3 of the largest output on these problems (fp32 outputs, so no output rounding in it)
FP8X_TOL = 4e-3


@needs_triton
@pytest.mark.parametrize("level", [1, 2])
@pytest.mark.parametrize("T, grouped", [(1, False), (5, False), (17, True)])
@pytest.mark.parametrize("xdtype", [torch.bfloat16, torch.float16])
def test_fp8_x_matches_the_dequantized_reference(T, grouped, xdtype, level):
    """The products on FP8 tensor cores against e4m3 planes (FP8_X 1: the up kernel's, against x's; 2: the down
    kernel's too, against h's, which the up kernel writes in groups of its 32 rows) agree with the reference on
    the same 16-bit x, per pair and grouped, D = 160 (a partial scale column and a partial chunk), I = 80 (a
    partial group of h)."""
    x, ids, w, gu, dn = _problem(T, D=160, I=80, block=(16, 64), seed=10 + T)
    x = x.to(xdtype)
    out = torch.empty(T, 160, dtype=torch.float32, device=DEVICE)
    F8.fp8_experts(x, ids, w, gu, dn, grouped=grouped, out=out, blocks={"FP8_X": level, "BLOCK_I": 32})
    _close(out, _reference(x.float(), ids, w, gu, dn), FP8X_TOL)


@needs_triton
def test_fp8_x_planes_rebuild_x_with_power_of_two_scales():
    """x = s_hi q_hi + s_lo q_lo within 2**-8 of each group's max; the scales are powers of two; a value whose
    rounding carries into the next binade (127.7 units -> 128, which the interpreter's own cast makes 64) and
    zeros rebuild as they should; an inf or NaN makes its group's scale NaN (the token's products NaN)."""
    T, D, G = 4, 200, 64
    g = torch.Generator().manual_seed(11)
    x = torch.randn(T, D, generator=g) * torch.tensor([1.0, 1e-3, 40.0, 1.0])[:, None]
    x[3, 64:128] = 0.0
    x[0, 0], x[0, 1] = 1.0, 127.7 / 128  # scale 2**-7 for the group: 1.0 is 128 units, 0.9977 is 127.7
    x[1, 150] = float("inf")
    x[2, 5] = torch.tensor(0x7FFFFFFF, dtype=torch.int32).view(torch.float32)  # the GPU's NaN: all mantissa bits
    x = x.to(DEVICE)
    ng = -(-D // G)
    q = torch.empty(2, T, D, dtype=torch.float8_e4m3fn, device=DEVICE)
    s = torch.empty(2, T, ng, dtype=torch.float32, device=DEVICE)
    F8.fp8_x_kernel[(T, ng)](x, q, s, x.stride(0), T * D, T * ng, D=D, G=G, NG=ng)
    q, s, x = q.float().cpu(), s.cpu(), x.cpu()
    assert torch.isnan(s[0, 1, 2]) and torch.isnan(q[0, 2, 5])  # no NaN rounds to a number (its bits + carry)
    ok = torch.isfinite(s[0])
    ok[2, 0] = False  # the NaN's group: its other values still rebuild, checked apart
    assert torch.isfinite(s[:, [0, 2, 3]]).all()
    sh, sl = (s[i].repeat_interleave(G, 1)[:, :D] for i in (0, 1))
    rebuilt = q[0] * sh + q[1] * sl
    assert rebuilt[0, 1] == x[0, 1] or abs(rebuilt[0, 1] - x[0, 1]) <= 2 ** -8 * x[0, :G].abs().max()
    assert q[0, 0, 1] * s[0, 0, 0] == 1.0  # 127.7 units rounded up to 128, not down to 64
    for t in range(T):
        for j in range(ng):
            if not ok[t, j]:
                continue
            sl_ = slice(j * G, min(D, (j + 1) * G))
            amax = x[t, sl_].abs().max()
            assert (rebuilt[t, sl_] - x[t, sl_]).abs().max() <= 2 ** -8 * amax, (t, j)
            for sc in (s[0, t, j], s[1, t, j]):
                m, e = torch.frexp(sc)
                assert m == 0.5, sc  # a power of two
    assert (rebuilt[3, 64:128] == 0).all()


@needs_triton
def test_fp8_x_propagates_inf_and_is_refused_for_fp32_activations(monkeypatch):
    """A token with an inf gets non-finite outputs, the others the same bits as without it; fp32 x with an
    explicit FP8_X is refused; with a tuned FP8_X (the tuner's activations are bf16) fp32 x runs the converted
    path."""
    x, ids, w, gu, dn = _problem(3, seed=12)
    x16 = x.to(torch.bfloat16)
    bad = x16.clone()
    bad[1, 7] = float("inf")
    for level in (1, 2):  # 2: through h's planes too
        clean = F8.fp8_experts(x16, ids, w, gu, dn, blocks={"FP8_X": level})
        out = F8.fp8_experts(bad, ids, w, gu, dn, blocks={"FP8_X": level})
        assert not torch.isfinite(out[1]).any()
        assert torch.equal(out[[0, 2]], clean[[0, 2]])
    with pytest.raises(ValueError, match="FP8_X takes 16-bit activations"):
        F8.fp8_experts(x, ids, w, gu, dn, blocks={"FP8_X": 1})
    for blocks, text in (({"FP8_X": 3}, "0, 1 or 2"), ({"FP8_X": 1, "BLOCK_D": 16}, "BLOCK_D = 16"),
                         ({"FP8_X": 2, "BLOCK_I": 16}, "BLOCK_I = 16")):
        with pytest.raises(ValueError, match=text):
            F8.fp8_experts(x16, ids, w, gu, dn, blocks=blocks)
    g16 = _fp8(torch.randn(8, 128, 96) / 96 ** 0.5, (16, 16))  # 16-column scale blocks: chunks of 16
    d16 = _fp8(torch.randn(8, 96, 64) / 8, (16, 16))
    with pytest.raises(ValueError, match="chunks of at least 32"):
        F8.fp8_experts(x16, ids, w, g16, d16, blocks={"FP8_X": 1})
    up = Recorder()
    monkeypatch.setattr(F8, "fp8_up_kernel", up)
    monkeypatch.setattr(F8, "fp8_down_kernel", Recorder())
    monkeypatch.setattr(F8, "combine_kernel", Recorder())
    monkeypatch.setattr(F8.tuning, "lookup", lambda *a: {"FP8_X": 1})
    monkeypatch.setattr(F8, "_device_name", lambda device: "Fake GPU 80GB")
    F8.fp8_experts(x, ids, w, gu, dn)
    assert up.launches[0][1]["FP8X"] is False
    F8.fp8_experts(x16, ids, w, gu, dn)
    assert up.launches[1][1]["FP8X"] is True


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
    calls = [{"dtype": "bf16"}, {"dtype": "fp32", "grouped": False}, {"dtype": "bf16", "fp8x": 1},
             {"dtype": "bf16", "fp8x": 2, "grouped": False}]
    rows = static_audits(("megadecode.backends.fused.kernels.fp8_experts", calls))
    assert [r[0] for r in rows] == (["fp8_up_kernel", "fp8_down_kernel", "combine_kernel"] * 2
                                    + ["fp8_x_kernel", "fp8_up_kernel", "fp8_down_kernel", "combine_kernel"] * 2)


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
