"""The CuTe DSL MXFP4 routed experts (backends/fused/kernels/cute_experts.py) and their weight order (quant/mxfp4_frag.py).

CPU: the fragment order round-trips; a model of the kernel's per-lane arithmetic (`emulate`: the words each lane
loads, the two shifts and masks a register, the mma fragment tables, the block scale shifted into fp32's exponent)
equals the exact dot products, so the order and the kernel's index arithmetic agree; refusals; the static audit of
every configuration the variant launches (compiled for sm_90a without a GPU). GPU (H200): the kernels against the
exact reference at per-pair and grouped batches, a skipped pair, bf16 input, poisoned outputs, repeat equality,
a CUDA graph replay; the variant through the harness's check_op on tiny-k3-wide.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from megadecode.quant.mxfp4 import MXFP4Tensor, dequantize_mxfp4
from megadecode.quant.mxfp4_frag import KREC, RECORD, MXFP4Frag, emulate, relayout, relayout_experts, restore


def _mx(E, R, K, seed=0, scale_lo=110, scale_hi=130):
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (E, R, K // 2), dtype=torch.uint8, generator=g)
    scales = torch.randint(scale_lo, scale_hi, (E, R, K // 32), dtype=torch.uint8, generator=g)
    return MXFP4Tensor(packed, scales)


@pytest.mark.parametrize("E,R,K", [(1, 16, 256), (3, 48, 512), (2, 32, 768)])
def test_relayout_round_trips(E, R, K):
    w = _mx(E, R, K, seed=E + R)
    f = relayout(w)
    assert f.data.shape == (E, R // 16, K // KREC, RECORD) and f.nbytes == w.nbytes
    back = restore(f)
    assert torch.equal(back.packed, w.packed) and torch.equal(back.scales, w.scales)


def test_records_hold_each_lanes_fragments():
    """One record by hand: lane 5 (g 1, c 1), chunk 0, word 0 holds rows 1 and 9 at k 8..11, register j's half h
    (row g + 8 (j % 2), k 8 c + 2 (j // 2) + h) with its magnitude bits at MAG_AT[j] + 16 h and its sign at
    SIGN_AT[j] + 16 h."""
    from megadecode.quant.mxfp4 import pack_codes
    from megadecode.quant.mxfp4_frag import MAG_AT, SIGN_AT

    R, K = 16, 256
    codes = torch.arange(R * K).reshape(1, R, K) % 16
    w = MXFP4Tensor(pack_codes(codes), torch.full((1, R, K // 32), 127, dtype=torch.uint8))
    word = int.from_bytes(bytes(relayout(w).data[0, 0, 0, 16 * 5:16 * 5 + 4].tolist()), "little")
    for j in range(4):
        for h in range(2):
            got = ((word >> (MAG_AT[j] + 16 * h)) & 7) | (((word >> (SIGN_AT[j] + 16 * h)) & 1) << 3)
            assert got == int(codes[0, 1 + 8 * (j % 2), 8 + 2 * (j // 2) + h]), (j, h)
    bits = sorted(b + 16 * h for j in range(4) for h in range(2) for b in (MAG_AT[j], MAG_AT[j] + 1, MAG_AT[j] + 2,
                                                                          SIGN_AT[j]))
    assert bits == list(range(32))  # every bit of the word holds one weight's bit


@pytest.mark.parametrize("seed", [0, 1])
def test_emulated_kernel_arithmetic_is_exact(seed):
    """The kernel's per-lane arithmetic on the records equals the dequantized weights' dot products (fp64, up to
    the order of the sums: 1e-13 relative; a wrong nibble, row, k or scale would be off by O(1); every scale and
    code, both signs, the 0.5 subnormal)."""
    w = _mx(2, 32, 512, seed=seed)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    ref = torch.einsum("erk,nk->ern", dequantize_mxfp4(w.packed, w.scales, torch.float64), x)
    assert float((emulate(relayout(w), x) - ref).abs().max()) <= 1e-13 * float(ref.abs().max())


def test_emulated_scale_byte_zero_reads_as_zero():
    """Scale byte 0 (2**-127) is read as 0 by the kernel's shift into fp32's exponent (the module doc)."""
    w = _mx(1, 16, 256, seed=3)
    w.scales[0, 2, 1] = 0
    x = torch.randn(2, 256, dtype=torch.float64)
    dq = dequantize_mxfp4(w.packed, w.scales, torch.float64)
    dq[0, 2, 32:64] = 0
    ref = torch.einsum("erk,nk->ern", dq, x)
    assert float((emulate(relayout(w), x) - ref).abs().max()) <= 1e-13 * float(ref.abs().max())


def test_relayout_refuses():
    with pytest.raises(ValueError, match="multiples|rows % 16"):
        relayout(_mx(1, 24, 256))
    with pytest.raises(ValueError, match="K % 256"):
        relayout(_mx(1, 16, 224))
    bad = _mx(1, 16, 256)
    bad.scales[0, 0, 0] = 255
    with pytest.raises(ValueError, match="NaN"):
        relayout(bad)
    with pytest.raises(ValueError, match="MXFP4Tensor"):
        relayout(torch.zeros(1, 16, 256))
    with pytest.raises(ValueError, match="stacked"):
        relayout(_mx(1, 16, 256)[0])
    with pytest.raises(ValueError, match="contiguous uint8"):
        MXFP4Frag(torch.zeros(1, 1, 1, RECORD - 1, dtype=torch.uint8), torch.Size((1, 16, 256)))
    with pytest.raises(ValueError, match="layout"):
        MXFP4Frag(torch.zeros(1, 1, 1, RECORD, dtype=torch.uint8), torch.Size((1, 16, 256)), layout="other")


def test_frag_of_relays_out_once_and_forgets_a_freed_weight():
    """frag_of: one fragment-ordered copy per weight (the same object however the weight is wrapped), made in
    chunks of experts equal to one relayout, dropped when the weight's storage is freed."""
    import gc

    from megadecode.backends.fused.kernels import cute_experts as ce

    w = _mx(5, 32, 256, seed=9)
    f = ce.frag_of(w)
    assert ce.frag_of(MXFP4Tensor(w.packed, w.scales)) is f and ce.frag_of((w.packed, w.scales)) is f
    assert ce.frag_of(f) is f
    assert torch.equal(relayout_experts(w, chunk=2).data, relayout(w).data)
    key = (w.packed.data_ptr(), w.scales.data_ptr(), tuple(w.shape))
    assert key in ce._FRAGS
    del w
    gc.collect()
    assert key not in ce._FRAGS


def test_launcher_refuses_bad_input_on_cpu():
    from megadecode.backends.fused.kernels.cute_experts import cute_experts

    gu, dn = relayout(_mx(4, 512, 256)), relayout(_mx(4, 256, 256))
    x = torch.randn(2, 256)
    ids = torch.zeros(2, 2, dtype=torch.int64)
    w = torch.ones(2, 2)
    with pytest.raises(ValueError, match="one CUDA device"):
        cute_experts(x, ids, w, gu, dn)
    with pytest.raises(ValueError, match="MXFP4Frag"):
        cute_experts(x, ids, w, _mx(4, 512, 256), dn)
    with pytest.raises(ValueError, match="disagree"):
        cute_experts(torch.randn(2, 512), ids, w, gu, dn)
    with pytest.raises(ValueError, match="ids"):
        cute_experts(x, ids.float(), w, gu, dn)
    with pytest.raises(ValueError, match="act"):
        cute_experts(x, ids, w, gu, dn, act="gelu")


def test_variant_scope():
    from megadecode.backends.fused.kernels.cute_experts import CUTE_LATENT_MOE_VARIANT as V
    from megadecode.presets import preset_config

    from megadecode.backends.fused.kernels.cute_experts import _k3_dims

    assert "multiples of 256" in _k3_dims(preset_config("tiny-k3"))  # the dims rule alone, on any machine
    if importlib.util.find_spec("cutlass") is not None:
        assert _k3_dims(preset_config("tiny-k3-wide")) is None
    assert "device cpu" in V.supports(preset_config("tiny-k3-wide"), torch.float32, 1, "cpu")
    assert "batch 257" in V.supports(preset_config("tiny-k3-wide"), torch.float32, 257, "cuda")


# ---- compiled for sm_90a on the CPU --------------------------------------------------------------------------
def test_static_audit_every_configuration():
    """Every configuration the variant launches: the records are the only non-coherent loads (per record a loop
    trip loads: 4 words and a scale line each of gate and up, 5 of down; grouped takes DEFAULT_TUNE's scu_grouped
    records a trip), nothing produced takes that path, no findings but the SASS rule's warning that the DSL's cubin
    carries no line table to attribute its loads by."""
    pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl (the test extra installs it)")
    from megadecode.backends.fused.kernels.cute_experts import DEFAULT_TUNE, audit_specs
    from megadecode.validate.audit import audit_spec

    for spec in audit_specs():
        rep = audit_spec(spec)
        assert rep.error is None, rep.error
        assert not [f for f in rep.findings if f.severity != "warn"], rep.findings
        assert all(params == ("wq",) for _, params in rep.nc_loads), rep.nc_loads
        pv = spec.path_values()
        scu = DEFAULT_TUNE["scu_grouped"] if pv["grouped"] else DEFAULT_TUNE["scu"]
        assert len(rep.nc_loads) == (10 if pv["up"] else 5) * scu, (spec.cfg, len(rep.nc_loads))
        assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in spec.compile().ptx


def test_registers_and_no_spills():
    """The default configurations stay within 128 registers (4 warps x 4 CTAs an SM); ptxas (CUDA 12.8's, -v) spills
    nothing without the remainder plane (bf16 / fp16 models) and at most 16 bytes with it (the up kernel per pair spilled 16
    when this test was written, at 64 registers)."""
    pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl (the test extra installs it)")
    import re

    from megadecode.backends.fused.kernels.cute_experts import audit_specs
    from megadecode.backends.mega.runtime import assemble

    for spec in audit_specs():
        cubin, report = assemble(spec.compile().ptx)
        if cubin is None:
            pytest.skip(report)
        regs = int(re.search(r"Used (\d+) registers", report).group(1))
        spills = [int(s) for s in re.findall(r"(\d+) bytes spill stores", report)]
        split = spec.path_values()["split"]
        assert regs <= 128 and max(spills, default=0) <= (16 if split else 0), (spec.cfg, regs, spills)


# ---- on the GPU -----------------------------------------------------------------------------------------------
gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _gpu_weights(E=64, D=512, I=256, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def one(out_dim, in_dim):
        return MXFP4Tensor(torch.randint(0, 256, (E, out_dim, in_dim // 2), device="cuda", dtype=torch.uint8,
                                         generator=g),
                           torch.randint(118, 124, (E, out_dim, in_dim // 32), device="cuda", dtype=torch.uint8,
                                         generator=g))
    return one(2 * I, D), one(D, I)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("T,grouped", [(1, False), (3, False), (16, False), (3, True), (17, True), (64, True)])
@pytest.mark.parametrize("split", [True, False])
def test_against_exact_reference(T, grouped, split):
    pytest.importorskip("cutlass")
    from megadecode.backends.fused.kernels.cute_experts import cute_experts, frag_of
    from megadecode.reference.latent_moe import latent_experts

    gu, dn = _gpu_weights()
    E, A = gu.shape[0], 8
    g = torch.Generator(device="cuda").manual_seed(T)
    ids = torch.argsort(torch.rand(T, E, device="cuda", generator=g), dim=1)[:, :A].contiguous()
    ids[0, 1] = -1  # a skipped pair
    x = torch.randn(T, gu.shape[2], device="cuda", generator=g)
    x[-1] *= 1e-3  # a small row: its own power-of-two scale
    w = torch.rand(T, A, device="cuda", generator=g) + 0.1
    ref = latent_experts(x, ids, w, gu, dn, "situ")
    outs = []
    for _ in range(2):
        out = torch.full_like(ref, float("nan"))
        cute_experts(x, ids, w, frag_of(gu), frag_of(dn), act="situ", out=out, grouped=grouped, split=split)
        outs.append(out)
    assert torch.isfinite(outs[0]).all()
    assert torch.equal(outs[0], outs[1])
    tol = 1e-5 if split else 4e-3  # fp16 activations: 11 bits; with the remainder plane ~22
    for t in range(T):  # per token: the small row is held to its own magnitude
        err = float((outs[0][t] - ref[t]).abs().max()) / float(ref[t].abs().max())
        assert err <= tol, (t, err)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bf16_input_silu_and_graph_replay():
    pytest.importorskip("cutlass")
    from megadecode.backends.fused.kernels.cute_experts import cute_experts, frag_of
    from megadecode.reference.latent_moe import latent_experts

    gu, dn = _gpu_weights(seed=1)
    E, A, T = gu.shape[0], 4, 5
    g = torch.Generator(device="cuda").manual_seed(7)
    ids = torch.argsort(torch.rand(T, E, device="cuda", generator=g), dim=1)[:, :A].contiguous()
    x = torch.randn(T, gu.shape[2], device="cuda", generator=g).bfloat16()
    w = torch.rand(T, A, device="cuda", generator=g)
    ref = latent_experts(x.float(), ids, w, gu, dn, "silu")
    fg, fd = frag_of(gu), frag_of(dn)
    out = torch.empty(T, gu.shape[2], device="cuda")
    cute_experts(x, ids, w, fg, fd, act="silu", out=out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cute_experts(x, ids, w, fg, fd, act="silu", out=out)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    assert float((out - ref).abs().max()) / float(ref.abs().max()) <= 4e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("batch", [1, 17])
def test_variant_passes_check_op_on_tiny_k3_wide(dtype, batch):
    pytest.importorskip("cutlass")
    from megadecode.presets import preset_config
    from megadecode.validate.catalog import get
    from megadecode.validate.checks import check_op

    row = check_op(get("cute-latent-moe"), preset_config("tiny-k3-wide"), "latent_moe", dtype, batch, seed=batch,
                   device="cuda")
    assert row["status"] == "PASS", row
