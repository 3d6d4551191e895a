"""FP8 block-scaled weights, as DeepSeek-V3, Kimi K2 and Qwen3-*-FP8 checkpoints ship them.

Legend: a weight [..., N, K] (N output rows, K the input / reduction dim); a block is bn x bk weights
(quantization_config `weight_block_size` [bn, bk], [128, 128] in every released checkpoint); the blocks at
the bottom and right edges are partial when N or K is not a multiple.

Element: float8_e4m3fn (1 sign, 4 exponent bits with bias 7, 3 mantissa bits; finite up to 448, no inf,
    0x7F / 0xFF are NaN).
Scale: `weight_scale_inv` [..., ceil(N/bn), ceil(K/bk)], fp32 (bf16 or e8m0 in some checkpoints: read as
    fp32, exactly): the factor that multiplies the stored values back.
Value: w[n, k] = float(fp8[n, k]) * scale_inv[n // bn, k // bk], computed in fp32 (the one rounding of the
    product; `dequantize_fp8`), as transformers' Fp8Dequantize and DeepSeek's reference weight_dequant do.
Quantization (`quantize_fp8`, for tests and random checkpoints): scale_inv = amax / 448 per block, fp8 =
    round-to-nearest-even(w / scale_inv) (torch's cast); an all-zero block gets scale_inv 1.

Stacked routed experts keep the layout with a leading expert dim: gate_up [E, 2I, D] fp8 with scales
[E, 2I/bn, ceil(D/bk)] (gate's block rows, then up's: I must be a multiple of bn so that they line up),
down [E, D, I] with [E, ceil(D/bn), ceil(I/bk)].
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16) + (
    (torch.float8_e8m0fnu,) if hasattr(torch, "float8_e8m0fnu") else ())


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The weight_scale_inv shape of a weight of `shape` [..., N, K]."""
    *lead, n, k = shape
    return (*lead, math.ceil(n / block[0]), math.ceil(k / block[1]))


def _expand(scale: torch.Tensor, n: int, k: int, block: tuple[int, int]) -> torch.Tensor:
    """scale_inv [..., ceil(n/bn), ceil(k/bk)] -> one value per weight [..., n, k]."""
    return scale.repeat_interleave(block[0], -2)[..., :n, :].repeat_interleave(block[1], -1)[..., :k]


def check_fp8(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> None:
    if w.dtype != FP8:
        raise ValueError(f"FP8 weight must be float8_e4m3fn, got {w.dtype}")
    if scale.dtype not in SCALE_DTYPES:
        raise ValueError(f"FP8 weight_scale_inv must be float32 (or bf16 / fp16 / e8m0), got {scale.dtype}")
    if w.dim() < 2 or tuple(scale.shape) != scale_shape(tuple(w.shape), block):
        raise ValueError(f"FP8 weight {tuple(w.shape)} with blocks {list(block)} needs weight_scale_inv "
                         f"{list(scale_shape(tuple(w.shape), block))}, got {list(scale.shape)}")


def dequantize_fp8(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(fp8 [..., N, K], scale_inv [..., ceil(N/bn), ceil(K/bk)]) -> weights [..., N, K] in `dtype`: the product
    in fp32, then cast."""
    check_fp8(w, scale, block)
    n, k = w.shape[-2:]
    return (w.float() * _expand(scale.float(), n, k, block)).to(dtype)


def quantize_fp8(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """float w [..., N, K] -> (fp8 [..., N, K], scale_inv fp32 [..., ceil(N/bn), ceil(K/bk)]); rules in the
    module doc."""
    if not isinstance(w, torch.Tensor) or not w.is_floating_point() or w.dim() < 2:
        raise ValueError(f"quantize_fp8 takes a floating-point tensor of >= 2 dims, got {getattr(w, 'shape', w)}")
    n, k = w.shape[-2:]
    bn, bk = block
    pn, pk = -n % bn, -k % bk
    x = torch.nn.functional.pad(w.float(), (0, pk, 0, pn))
    x = x.unflatten(-1, (x.shape[-1] // bk, bk)).unflatten(-3, (x.shape[-2] // bn, bn))  # [..., Nb, bn, Kb, bk]
    amax = x.abs().amax(dim=(-3, -1))  # [..., Nb, Kb]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w.float() / _expand(scale, n, k, block)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


@dataclass(frozen=True)
class FP8Tensor:
    """A weight [..., N, K] stored as FP8 with block scales. Indexing the leading dims (`t[e]`) selects rows of
    both tensors, e.g. one expert of a stacked [E, out, K] weight, without decoding anything."""
    data: torch.Tensor
    scales: torch.Tensor
    block: tuple[int, int]

    def __post_init__(self):
        check_fp8(self.data, self.scales, self.block)

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def nbytes(self) -> int:
        return self.data.numel() + self.scales.numel() * self.scales.element_size()

    def __getitem__(self, index) -> "FP8Tensor":
        d, s = self.data[index], self.scales[index]
        if d.dim() < 2 or d.shape[-2:] != self.data.shape[-2:]:
            raise IndexError("FP8Tensor indexes leading dims only")
        return FP8Tensor(d, s, self.block)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_fp8(self.data, self.scales, self.block, dtype)
