"""MXFP4 (OCP Microscaling, FP4 elements): e2m1 values with one e8m0 scale per 32 weights.

Legend: K the input (reduction) dim of a weight [..., K]; a block is 32 consecutive weights along K.

Element, e2m1 (4 bits, `s ee m`): code & 0x8 is the sign, code & 0x7 the magnitude index into
    (0, 0.5, 1, 1.5, 2, 3, 4, 6)  -- exponent bias 1, one subnormal (0.5); no inf, no NaN.
Scale, e8m0 (uint8 e): 2**(e - 127); e = 255 is NaN (rejected unless `allow_nan`).
Value: w = e2m1(code) * 2**(e - 127).

Packing, as compressed-tensors' `mxfp4-pack-quantized` format (the NVFP4PackedCompressor it
aliases: `packed = code[2j] | code[2j+1] << 4`, unpack `stack((low, high))`): two codes per byte
along K, the EVEN element in the LOW nibble, the odd element in the high nibble.
Checkpoint tensors (compressed-tensors names, per linear `<module>`):
    `<module>.weight_packed` uint8 [out, K/2], `<module>.weight_scale` uint8 e8m0 [out, K/32].
Fused expert stacks keep the same layout with a leading expert dim: [E, out, K/2] and [E, out, K/32].
Storage: K/2 + K/32 bytes per row of K weights = 4.25 bits/weight.

Scale rule (quantize_mxfp4): the smallest power of two that makes the block max fit,
    e = ceil(log2(amax / 6)), so amax / 2**e <= 6 and nothing clips (clamped to the e8m0 range
    [-127, 127]; an all-zero block gets e = -127, byte 0). This is what compressed-tensors'
    `generate_mxfp4_scales` computes up to its bf16 rounding of amax; the OCP spec's suggested
    floor(log2(amax)) - 2 instead clips block maxima in (6, 8) * 2**e to 6.
Element rounding: round to the nearest e2m1 value, ties to the even code (even mantissa bit), as
    IEEE round-to-nearest-even; |x| / 2**e is computed exactly (fp64, power-of-two scale).
Dequantization is exact in fp32 and bf16 (e2m1 values have 2 significant bits); the largest
    scales (6 * 2**127) overflow fp32 to inf, as the format allows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32
E8M0_BIAS = 127
E8M0_NAN = 255
PACKED_NAME = "weight_packed"  # compressed-tensors checkpoint suffixes
SCALE_NAME = "weight_scale"

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# code -> value for all 16 codes (code 8 is -0.0)
E2M1_VALUES = tuple(E2M1_MAGNITUDES) + tuple(-v for v in E2M1_MAGNITUDES)
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # rounding boundaries between magnitudes


def _check_uint8(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8:
        got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"MXFP4 {name} must be a uint8 tensor, got {got}")


def check_mxfp4(packed: torch.Tensor, scales: torch.Tensor, allow_nan: bool = False) -> int:
    """Validate a (packed [..., K/2], scales [..., K/32]) pair; returns K."""
    _check_uint8("packed", packed)
    _check_uint8("scales", scales)
    if packed.dim() == 4 and scales.dim() == 3 and scales.shape[-1] == 0:
        raise ValueError(f"MXFP4 packed {tuple(packed.shape)} with empty scales is a weight in fragment order "
                         "(quant/mxfp4_frag.py, re-laid out for the fused executor's CuTe experts): this path reads "
                         "the checkpoint's order (backends/expert_layout.py converts between the two)")
    if packed.dim() == 0 or packed.shape[:-1] != scales.shape[:-1]:
        raise ValueError(f"MXFP4 packed {tuple(packed.shape)} and scales {tuple(scales.shape)} "
                         "must agree on every dim but the last")
    K = packed.shape[-1] * 2
    if K % BLOCK or scales.shape[-1] != K // BLOCK:
        raise ValueError(f"MXFP4 packed {tuple(packed.shape)} holds K={K} weights per row: K must be a "
                         f"multiple of {BLOCK} with K/{BLOCK} scales, got {scales.shape[-1]} scales")
    if not allow_nan and bool((scales == E8M0_NAN).any()):
        raise ValueError("MXFP4 scales contain the e8m0 NaN byte 255 (pass allow_nan=True to decode it as NaN)")
    return K


def e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """uint8 e -> fp32 2**(e - 127), exactly (bit construction; e = 0 is the subnormal 2**-127, 255 NaN)."""
    e = scales.to(torch.int32)
    normal = (e << 23).view(torch.float32)  # e in 1..254: biased fp32 exponent, zero mantissa
    out = torch.where(e == 0, torch.full_like(normal, 2.0 ** -127), normal)
    return torch.where(e == E8M0_NAN, torch.full_like(out, float("nan")), out)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> codes uint8 [..., K] (element 2j from the low nibble, 2j+1 from the high)."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """codes (0..15) [..., K] -> uint8 [..., K/2], element 2j in the low nibble."""
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32,
                     allow_nan: bool = False) -> torch.Tensor:
    """(packed uint8 [..., K/2], scales uint8 [..., K/32]) -> weights [..., K] in `dtype`, exactly."""
    K = check_mxfp4(packed, scales, allow_nan)
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    vals = lut[unpack_codes(packed).long()]  # [..., K]
    blocks = vals.unflatten(-1, (K // BLOCK, BLOCK)) * e8m0_to_float(scales)[..., None]
    return blocks.flatten(-2).to(dtype)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float w [..., K] -> (packed uint8 [..., K/2], scales uint8 [..., K/32]); rules in the module doc."""
    if not isinstance(w, torch.Tensor) or not w.is_floating_point():
        raise ValueError(f"quantize_mxfp4 takes a floating-point tensor, got {getattr(w, 'dtype', type(w))}")
    if w.dim() == 0 or w.shape[-1] % BLOCK:
        raise ValueError(f"MXFP4 needs the last dim to be a multiple of {BLOCK}, got shape {tuple(w.shape)}")
    if not bool(torch.isfinite(w).all()):
        raise ValueError("quantize_mxfp4: input contains inf or NaN")
    x = w.double().unflatten(-1, (w.shape[-1] // BLOCK, BLOCK))  # [..., K/32, 32]
    amax = x.abs().amax(-1)  # [..., K/32]
    # amax = m * 2**ex with m in [0.5, 1): amax / 2**(ex-3) = 8m in [4, 8), fits 6 iff 8m <= 6
    m, ex = torch.frexp(amax)
    e = torch.where(m * 8 > 6, ex - 2, ex - 3)
    e = torch.where(amax == 0, torch.full_like(e, -E8M0_BIAS), e).clamp(-E8M0_BIAS, E8M0_BIAS)
    y = torch.ldexp(x.abs(), -e[..., None].double())  # exact: power-of-two scale in fp64
    mids = torch.tensor(_MIDPOINTS, dtype=torch.float64, device=w.device)
    idx = torch.searchsorted(mids, y.contiguous())  # number of midpoints < y: nearest, ties low
    tie = y == mids[idx.clamp(max=len(_MIDPOINTS) - 1)]
    idx = idx + (tie & (idx % 2 == 1)).long()  # ties go to the even code
    codes = idx | (torch.signbit(x).long() << 3)
    return pack_codes(codes.flatten(-2)), (e + E8M0_BIAS).to(torch.uint8)


@dataclass(frozen=True)
class MXFP4Tensor:
    """A weight [..., K] stored as MXFP4: packed uint8 [..., K/2] + e8m0 scales uint8 [..., K/32].

    Indexing the leading dims (`t[e]`, `t[ids]`) selects rows of both tensors, e.g. one expert of a
    stacked [E, out, K] weight, without decoding anything.
    """
    packed: torch.Tensor
    scales: torch.Tensor

    def __post_init__(self):
        check_mxfp4(self.packed, self.scales, allow_nan=True)

    @classmethod
    def quantize(cls, w: torch.Tensor) -> "MXFP4Tensor":
        return cls(*quantize_mxfp4(w))

    @classmethod
    def from_state_dict(cls, sd: dict, prefix: str) -> "MXFP4Tensor":
        """`<prefix>.weight_packed` / `<prefix>.weight_scale` (compressed-tensors names)."""
        return cls(sd[f"{prefix}.{PACKED_NAME}"], sd[f"{prefix}.{SCALE_NAME}"])

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.packed.shape[:-1], self.packed.shape[-1] * 2))

    @property
    def nbytes(self) -> int:
        """Bytes stored: K/2 + K/32 per row, 4.25 bits per weight."""
        return self.packed.numel() * self.packed.element_size() + self.scales.numel() * self.scales.element_size()

    def __getitem__(self, index) -> "MXFP4Tensor":
        if isinstance(index, tuple) and any(i is Ellipsis for i in index):
            raise IndexError("MXFP4Tensor indexes leading dims only (no Ellipsis)")
        p, s = self.packed[index], self.scales[index]
        if p.dim() == 0 or p.shape[-1] != self.packed.shape[-1]:
            raise IndexError("MXFP4Tensor indexes leading dims only, never the packed K dim")
        return MXFP4Tensor(p, s)

    def dequantize(self, dtype: torch.dtype = torch.float32, allow_nan: bool = False) -> torch.Tensor:
        return dequantize_mxfp4(self.packed, self.scales, dtype, allow_nan)
