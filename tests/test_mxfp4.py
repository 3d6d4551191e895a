"""MXFP4: exact decoding against a per-element bit-level decoder, round trips, error bound, guards."""

from __future__ import annotations

import math

import pytest
import torch

from megadecode.quant.mxfp4 import (MXFP4Tensor, dequantize_mxfp4, quantize_mxfp4)


def decode_e2m1_bits(code: int) -> float:
    """Independent e2m1 decoder from the bit fields: sign s, exponent ee (bias 1), mantissa m."""
    s, ee, m = (code >> 3) & 1, (code >> 1) & 3, code & 1
    mag = (m / 2) if ee == 0 else (1 + m / 2) * 2.0 ** (ee - 1)  # ee == 0: subnormal 0.m * 2**0
    return -mag if s else mag


def slow_dequantize(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Python loops over a 2-D (rows, K/2) packed tensor; low nibble = even element."""
    rows, half = packed.shape
    out = torch.empty(rows, half * 2, dtype=torch.float64)  # 6 * 2**127 fits fp64, not fp32
    for r in range(rows):
        for j in range(half):
            byte = int(packed[r, j])
            for k, code in ((2 * j, byte & 0xF), (2 * j + 1, byte >> 4)):
                out[r, k] = decode_e2m1_bits(code) * 2.0 ** (int(scales[r, k // 32]) - 127)
    return out.float()  # overflow -> inf, the rest exact


def test_sixteen_codes_decode():
    expect = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    assert [decode_e2m1_bits(c) for c in range(16)] == expect
    # one row of 32: codes 0..15 in element order, scale byte 127 (x1)
    codes = torch.arange(32) % 16
    packed = (codes[0::2] | (codes[1::2] << 4)).to(torch.uint8)[None]
    got = dequantize_mxfp4(packed, torch.tensor([[127]], dtype=torch.uint8))[0]
    assert got.tolist() == expect * 2
    assert torch.signbit(got[8])  # code 8 is -0.0


def test_even_element_in_low_nibble():
    packed = torch.zeros(1, 16, dtype=torch.uint8)
    packed[0, 0] = 0x72  # element 0: code 2 (1.0), element 1: code 7 (6.0)
    got = dequantize_mxfp4(packed, torch.tensor([[128]], dtype=torch.uint8))  # x2
    assert got[0, :3].tolist() == [2.0, 12.0, 0.0]


def test_random_bytes_match_slow_decoder():
    g = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (3, 64), dtype=torch.uint8, generator=g)
    scales = torch.tensor([[0, 1, 127, 254], [100, 130, 127, 126], [120, 121, 140, 2]], dtype=torch.uint8)
    fast = dequantize_mxfp4(packed, scales)
    slow = slow_dequantize(packed, scales)
    assert torch.equal(torch.isinf(fast), torch.isinf(slow))  # 6 * 2**127 overflows fp32 in both
    fin = torch.isfinite(slow)
    assert torch.equal(fast[fin], slow[fin])
    assert torch.equal(torch.signbit(fast), torch.signbit(slow))
    assert torch.equal(dequantize_mxfp4(packed, scales, torch.bfloat16)[fin].float(), slow[fin])


def test_quantize_dequantize_roundtrip_is_identity_on_representable():
    """Blocks whose max magnitude is code 7 (6.0): the scale rule picks the same scale back."""
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (2, 5, 128), generator=g)
    codes[..., ::32] = 7  # each block holds +6
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    scales = torch.randint(1, 250, (2, 5, 4), dtype=torch.uint8, generator=g)
    w = dequantize_mxfp4(packed, scales)
    p2, s2 = quantize_mxfp4(w)
    assert torch.equal(s2, scales) and torch.equal(p2, packed)
    # values representable at a coarser scale round-trip by value (scale may differ)
    v = dequantize_mxfp4(*quantize_mxfp4(torch.tensor([[0.5, -3.0, 1.5] + [0.0] * 29])))
    assert v[0, :3].tolist() == [0.5, -3.0, 1.5]


def test_error_bound_per_block():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(16, 256, generator=g) * torch.logspace(-6, 3, 16)[:, None]
    packed, scales = quantize_mxfp4(w)
    err = (dequantize_mxfp4(packed, scales) - w).abs().unflatten(-1, (8, 32))
    scale = 2.0 ** (scales.double() - 127)
    amax = w.abs().unflatten(-1, (8, 32)).amax(-1).double()
    assert bool((amax <= 6 * scale).all()) and bool((amax > 3 * scale).all())  # smallest fitting scale
    # nearest rounding: at most half the widest e2m1 step (2, between 4 and 6) times the scale
    assert bool((err.amax(-1).double() <= scale).all())
    # and at most a quarter-ulp-relative: the spacing around |x| is <= |x|/2 above 1, so err <= max(|x|/4, scale/4)
    rel_bound = torch.maximum(w.abs().unflatten(-1, (8, 32)).double() / 4, scale[..., None] / 4)
    assert bool((err.double() <= rel_bound).all())


def test_rounding_ties_to_even_and_zero_block():
    # block max 6 fixes the scale at 1; ties between neighbours go to the even code
    row = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0, 0.3, 7e-9] + [0.0] * 21)
    got = dequantize_mxfp4(*quantize_mxfp4(row[None]))[0, :11]
    assert got.tolist() == [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -4.0, 0.5, 0.0]
    p, s = quantize_mxfp4(torch.zeros(1, 32))
    assert int(s[0, 0]) == 0 and not bool(p.any())
    # block max in (6, 8): scale 2 so nothing clips
    p, s = quantize_mxfp4(torch.tensor([[7.0] + [0.0] * 31]))
    assert int(s[0, 0]) == 128 and dequantize_mxfp4(p, s)[0, 0].item() == 8.0


def test_container_bytes_and_k3_expert_size():
    w = torch.randn(2, 64, 96)
    t = MXFP4Tensor.quantize(w)
    assert t.shape == w.shape and t.nbytes == w.numel() * 4.25 / 8
    assert torch.equal(t[1].dequantize(), t.dequantize()[1])
    assert torch.equal(t[torch.tensor([1, 0])].dequantize(), t.dequantize()[[1, 0]])
    # K3 routed expert: gate_up [2*3072, 3584] + down [3584, 3072] at 4.25 bits/weight
    I, R = 3072, 3584
    expert_bytes = (MXFP4Tensor(torch.zeros(2 * I, R // 2, dtype=torch.uint8),
                                torch.zeros(2 * I, R // 32, dtype=torch.uint8)).nbytes
                    + MXFP4Tensor(torch.zeros(R, I // 2, dtype=torch.uint8),
                                  torch.zeros(R, I // 32, dtype=torch.uint8)).nbytes)
    assert expert_bytes == (2 * I * R + R * I) * 4.25 / 8 == 17_547_264
    assert round(expert_bytes / 1e6, 2) == 17.55  # SPEC: 17.55 MB per expert


def test_from_state_dict_names():
    p, s = quantize_mxfp4(torch.randn(4, 64))
    t = MXFP4Tensor.from_state_dict({"mlp.down.weight_packed": p, "mlp.down.weight_scale": s}, "mlp.down")
    assert torch.equal(t.packed, p) and torch.equal(t.scales, s)


@pytest.mark.parametrize("packed, scales, match", [
    (torch.zeros(2, 8, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.uint8), "multiple of 32"),
    (torch.zeros(2, 16, dtype=torch.int8), torch.zeros(2, 1, dtype=torch.uint8), "uint8"),
    (torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.float32), "uint8"),
    (torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(3, 1, dtype=torch.uint8), "agree"),
    (torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8), "scales"),
    (torch.zeros(2, 16, dtype=torch.uint8), torch.full((2, 1), 255, dtype=torch.uint8), "NaN"),
])
def test_dequantize_rejects(packed, scales, match):
    with pytest.raises(ValueError, match=match):
        dequantize_mxfp4(packed, scales)


def test_nan_scale_allowed_on_request_and_quantize_guards():
    got = dequantize_mxfp4(torch.zeros(1, 16, dtype=torch.uint8), torch.full((1, 1), 255, dtype=torch.uint8),
                           allow_nan=True)
    assert bool(torch.isnan(got).all())
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp4(torch.randn(4, 48))
    with pytest.raises(ValueError, match="floating-point"):
        quantize_mxfp4(torch.zeros(4, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match="inf or NaN"):
        quantize_mxfp4(torch.tensor([[math.inf] + [0.0] * 31]))
