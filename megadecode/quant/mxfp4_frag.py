"""MXFP4 weights re-laid out once, at load time, in the order a tensor-core kernel's inner loop reads them
(backends/fused/kernels/cute_experts.py): each lane's 16-byte load is its own A fragments of mma.sync m16n8k16, and the
block scales of those weights sit next to them.

Legend: a weight [E, R, K] (R output rows, K the reduction dim); a tile = 16 consecutive rows; a record = one
tile over 256 consecutive k (8 scale blocks of 32); lane = 4 g + c (g = lane / 4 the fragment's row group,
c = lane % 4 its column pair), as PTX's m16n8k16 fragment tables name them.

Record (RECORD = 2176 bytes, 16-byte aligned), records ordered [E, R / 16, K / 256]:
    bytes 512 q + 16 lane + 4 w     (q = 0..3: k chunk 64 q .. 64 q + 63; w = 0..3 the lane's words)
        word w is k-step s = w of chunk q: scale block b = w // 2 of the chunk (block 2 q + b of the record),
        half s2 = w % 2 of it. It holds 8 e2m1 codes (s e1 e0 m), two a register j = 0..3 (its fp16 halves
        h = 0, 1): register j covers row g + 8 (j % 2), k = 64 q + 32 b + 8 c + 4 s2 + 2 (j // 2) + h. The
        code's magnitude bits e1 e0 m sit at bits MAG_AT[j] + 16 h .. + 2 and its sign at SIGN_AT[j] + 16 h:
        registers 0 and 1 are each one shift (none, 3) and one mask away from fp16, 2 and 3 two shifts
        (magnitude and sign apart): 11 integer operations a word, where the nibble order took 16.
    bytes 2048 + 16 g + 8 r + m     the e8m0 scale of row g + 8 r, block m (0..7) of the record.
The k order inside a block is permuted (thread c's fragment columns 2c, 2c+1, 2c+8, 2c+9 of both k-steps are the
8 consecutive k = 32 b + 8 c .. + 7): a dot product does not depend on the order of its terms, so the kernel
reads the matching activations as one 16-byte load per block, and an mma's k-step never crosses a scale block, so
the block scale multiplies the mma's fp32 sums.

Decode (backends/fused/kernels/cute_experts.py, `emulate` here): register j = ((word << (9 - MAG_AT[j])) & 0x0E000E00) |
((word << (15 - SIGN_AT[j])) & 0x80008000) (one mask 0x8E008E00 when both shifts agree) is the fp16 pair whose
values are e2m1 * 2**-14 exactly (the magnitude bits e1 e0 m land on fp16's exponent's two low bits and its top mantissa
bit; 0.5 is the fp16 subnormal 2**-15); the kernel multiplies a block's sum by 2**(e - 127) (the scale byte
shifted into fp32's exponent field, so byte 0 reads as 0 instead of 2**-127: a block of weights below 3.6e-38)
and the whole sum by 2**14. Byte 255 (NaN) is refused here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .mxfp4 import E8M0_NAN, MXFP4Tensor, pack_codes, unpack_codes

TILE = 16  # rows per record
KREC = 256  # k per record
WBYTES = 2048  # weight bytes per record
RECORD = WBYTES + 128  # + 16 rows x 8 scale bytes
LAYOUT = "mma16816-v2"  # the name the weight table records for this order
MAG_AT = (9, 6, 0, 3)  # register j's magnitude bits (e1 e0 m) from this bit of each 16-bit half (module doc)
SIGN_AT = (15, 12, 13, 14)  # and its sign bit
MAG_MASK, SIGN_MASK = 0x0E000E00, 0x80008000


def _check_shape(R: int, K: int) -> None:
    if R % TILE or K % KREC:
        raise ValueError(f"the fragment-ordered MXFP4 layout needs rows % {TILE} == 0 and K % {KREC} == 0, "
                         f"got rows {R}, K {K}")


@dataclass(frozen=True)
class MXFP4Frag:
    """A stacked MXFP4 weight [E, R, K] in fragment order: `data` uint8 [E, R / 16, K / 256, RECORD]."""
    data: torch.Tensor
    shape: torch.Size
    layout: str = LAYOUT

    def __post_init__(self):
        E, R, K = self.shape
        _check_shape(R, K)
        want = (E, R // TILE, K // KREC, RECORD)
        if not isinstance(self.data, torch.Tensor) or self.data.dtype != torch.uint8 or tuple(self.data.shape) != want \
                or not self.data.is_contiguous():
            got = (getattr(self.data, "dtype", type(self.data).__name__), tuple(getattr(self.data, "shape", ())))
            raise ValueError(f"MXFP4Frag data must be contiguous uint8 {want}, got {got}")
        if self.layout != LAYOUT:
            raise ValueError(f"unknown MXFP4 fragment layout {self.layout!r} (this build reads {LAYOUT!r})")

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @property
    def device(self) -> torch.device:
        return self.data.device


def relayout(w: MXFP4Tensor) -> MXFP4Frag:
    """[E, R, K] MXFP4 (packed [E, R, K/2], scales [E, R, K/32]) -> fragment order (the module doc). Refuses
    scale byte 255 (NaN), shapes the order cannot hold, and anything but a stacked 3-d weight."""
    if not isinstance(w, MXFP4Tensor):
        raise ValueError(f"relayout takes an MXFP4Tensor, got {type(w).__name__}")
    if w.packed.dim() != 3:
        raise ValueError(f"relayout takes a stacked [E, R, K] weight, got shape {tuple(w.shape)}")
    E, R, K = w.shape
    _check_shape(R, K)
    if bool((w.scales == E8M0_NAN).any()):
        raise ValueError("MXFP4 scales hold the e8m0 NaN byte 255: no fragment layout for NaN weights")
    T, S = R // TILE, K // KREC
    codes = unpack_codes(w.packed)  # [E, R, K]
    # rows 16 t + 8 r + g; k = 256 sc + 64 q + 32 b + 8 c + 4 s2 + 2 jh + h
    c = codes.view(E, T, 2, 8, S, 4, 2, 4, 2, 2, 2)  # E t r g sc q b c s2 jh h
    # -> E t sc q (g c) (b s2) h jh r: register j = r + 2 jh, half h
    c = c.permute(0, 1, 4, 5, 3, 7, 6, 8, 10, 9, 2).reshape(E, T, S, 512, 2, 4).to(torch.int64)
    word = torch.zeros(E, T, S, 512, dtype=torch.int64, device=codes.device)
    for h in range(2):
        for j in range(4):
            cj = c[..., h, j]
            word |= ((cj & 7) << (MAG_AT[j] + 16 * h)) | ((cj >> 3) << (SIGN_AT[j] + 16 * h))
    wbytes = torch.stack([(word >> (8 * i)) & 0xFF for i in range(4)], dim=-1).to(torch.uint8).reshape(E, T, S, WBYTES)
    s = w.scales.view(E, T, 2, 8, S, 8).permute(0, 1, 4, 3, 2, 5).reshape(E, T, S, 128)  # E t sc g r m
    return MXFP4Frag(torch.cat((wbytes, s), dim=-1).contiguous(), w.shape)


def relayout_experts(w: MXFP4Tensor, chunk: int = 8) -> MXFP4Frag:
    """relayout of a stacked [E, R, K] weight `chunk` experts at a time, into one preallocated tensor: relayout's
    intermediates take ~10 bytes a weight (codes, their int64 copy, the words), so a whole K3 gate_up at once
    would need ~200 GB; this needs the result plus one chunk's (~1.8 GB for 8 of K3's gate_up experts)."""
    if not isinstance(w, MXFP4Tensor):
        raise ValueError(f"relayout_experts takes an MXFP4Tensor, got {type(w).__name__}")
    if w.packed.dim() != 3:
        raise ValueError(f"relayout_experts takes a stacked [E, R, K] weight, got shape {tuple(w.shape)}")
    E, R, K = w.shape
    _check_shape(R, K)
    out = torch.empty(E, R // TILE, K // KREC, RECORD, dtype=torch.uint8, device=w.packed.device)
    for e0 in range(0, E, chunk):
        out[e0:e0 + chunk] = relayout(w[e0:e0 + chunk]).data
    return MXFP4Frag(out, w.shape)


def restore_experts(f: MXFP4Frag, chunk: int = 8) -> MXFP4Tensor:
    """restore, `chunk` experts at a time into preallocated tensors (relayout_experts' inverse)."""
    E, R, K = f.shape
    packed = torch.empty(E, R, K // 2, dtype=torch.uint8, device=f.data.device)
    scales = torch.empty(E, R, K // 32, dtype=torch.uint8, device=f.data.device)
    for e0 in range(0, E, chunk):
        part = restore(MXFP4Frag(f.data[e0:e0 + chunk], torch.Size((min(chunk, E - e0), R, K))))
        packed[e0:e0 + chunk], scales[e0:e0 + chunk] = part.packed, part.scales
    return MXFP4Tensor(packed, scales)


# ---- a stacked weight's two entries of the weight table (weights.py) in either order -------------------------
# In the checkpoint's order a stacked MXFP4 weight [E, R, K] is two entries, `.weight_packed` [E, R, K/2] and
# `.weight_scale` [E, R, K/32]. Re-laid out (an executor that reads this order: backends/expert_layout.py), the
# records take the `.weight_packed` entry, [E, R/16, K/256, RECORD], and `.weight_scale` holds an empty
# [E, R, 0] (the scales are inside the records): the entries' shapes say which order a weight is in.
def entry_shape(name: str, shape: tuple) -> tuple:
    """The fragment-order shape of a weight-table entry whose checkpoint-order shape is `shape` (the name's
    suffix says which half)."""
    E, R, last = shape
    if name.endswith(".weight_packed"):
        _check_shape(R, 2 * last)
        return (E, R // TILE, 2 * last // KREC, RECORD)
    if name.endswith(".weight_scale"):
        return (E, R, 0)
    raise ValueError(f"{name!r} is not one half of an MXFP4 weight (.weight_packed / .weight_scale)")


def is_frag_entry(packed: torch.Tensor) -> bool:
    """Whether a `.weight_packed` entry holds records (fragment order) rather than packed codes."""
    return packed.dim() == 4


def frag_from_entries(packed: torch.Tensor, scales: torch.Tensor) -> MXFP4Frag:
    """The MXFP4Frag held by a weight's two entries in fragment order, or a ValueError naming what is wrong."""
    if not is_frag_entry(packed) or scales.dim() != 3 or scales.shape[-1] != 0 \
            or tuple(scales.shape[:2]) != (packed.shape[0], packed.shape[1] * TILE):
        raise ValueError(f"not a fragment-ordered MXFP4 weight: packed {tuple(packed.shape)}, scales "
                         f"{tuple(scales.shape)} (want [E, R/{TILE}, K/{KREC}, {RECORD}] and [E, R, 0])")
    E, T, S, _ = packed.shape
    return MXFP4Frag(packed, torch.Size((E, T * TILE, S * KREC)))


def entries_of(f: MXFP4Frag) -> tuple[torch.Tensor, torch.Tensor]:
    """A fragment-ordered weight as its two entries (records, the empty scales placeholder)."""
    E, R, _ = f.shape
    return f.data, f.data.new_empty((E, R, 0))


def restore(f: MXFP4Frag) -> MXFP4Tensor:
    """The inverse of relayout (round-trip tests; the checkpoint's order back)."""
    E, R, K = f.shape
    T, S = R // TILE, K // KREC
    d = f.data[..., :WBYTES].reshape(E, T, S, 512, 4).to(torch.int64)
    word = d[..., 0] | (d[..., 1] << 8) | (d[..., 2] << 16) | (d[..., 3] << 24)
    codes = torch.stack([torch.stack([((word >> (MAG_AT[j] + 16 * h)) & 7) | (((word >> (SIGN_AT[j] + 16 * h)) & 1) << 3)
                                      for j in range(4)], dim=-1) for h in range(2)], dim=-2)  # .. 512 h j
    c = codes.view(E, T, S, 4, 8, 4, 2, 2, 2, 2, 2)  # E t sc q g c b s2 h jh r
    c = c.permute(0, 1, 10, 4, 2, 3, 6, 5, 7, 9, 8).reshape(E, R, K)  # -> E t r g sc q b c s2 jh h
    s = f.data[..., WBYTES:].reshape(E, T, S, 8, 2, 8).permute(0, 1, 4, 3, 2, 5).reshape(E, R, K // 32)
    return MXFP4Tensor(pack_codes(c.to(torch.uint8)).contiguous(), s.contiguous())


# ---- a model of the kernel's per-lane arithmetic (CPU tests pin the layout contract with it) ------------------
def _decode_words(words: torch.Tensor) -> torch.Tensor:
    """int64 words [...] -> fp32 [..., 4, 2]: register j, half h, by exactly the kernel's shifts and masks, read
    back as fp16 (= e2m1 * 2**-14)."""
    out = []
    for j in range(4):
        reg = (((words << (9 - MAG_AT[j])) & MAG_MASK) | ((words << (15 - SIGN_AT[j])) & SIGN_MASK)) & 0xFFFFFFFF
        halves = torch.stack((reg & 0xFFFF, reg >> 16), dim=-1).to(torch.int16)
        out.append(halves.view(torch.float16).float())
    return torch.stack(out, dim=-2)


def emulate(f: MXFP4Frag, x: torch.Tensor) -> torch.Tensor:
    """y [E, R, N] = W_e x_n^T computed the way the kernel does, from the records: per lane, its 16-byte words
    decoded to A registers (mma.sync m16n8k16 row-major fragment table), its activations B[k, n] taken from
    k = 32 b + 8 c + 4 s2 + {0, 1} (b0) and + {2, 3} (b1), each k-step's product summed, a block's sum times
    2**14 2**(e - 127) with e the scale byte shifted into fp32's exponent (byte 0 -> 0). x: [N, K] fp32/fp64."""
    E, R, K = f.shape
    T, S = R // TILE, K // KREC
    d = f.data.to(torch.int64)
    wb = d[..., :WBYTES].view(E, T, S, 4, 32, 4, 4)  # .. q lane w byte
    words = wb[..., 0] | (wb[..., 1] << 8) | (wb[..., 2] << 16) | (wb[..., 3] << 24)  # E T S q lane w
    regs = _decode_words(words)  # E T S q lane w j h
    # A[row, col] of k-step (q, w): lane (g, c): reg0 (g, 2c + h), reg1 (g + 8, 2c + h), reg2 (g, 2c + 8 + h),
    # reg3 (g + 8, 2c + 8 + h)
    A = torch.zeros(E, T, S, 4, 4, 16, 16, dtype=torch.float64)
    g = torch.arange(32) // 4
    cc = torch.arange(32) % 4
    for j in range(4):
        for h in range(2):
            row = g + 8 * (j % 2)
            col = 2 * cc + 8 * (j // 2) + h
            A[:, :, :, :, :, row, col] = regs[..., j, h].double().permute(0, 1, 2, 3, 5, 4)
    # B[col, n] for k-step (q, w), column col: lane c = (col % 8) // 2 holds it; k = 32 b + 8 c + 4 s2 + 2 (col // 8)
    # + col % 2 with b = w // 2, s2 = w % 2
    col = torch.arange(16)
    kk = torch.empty(S, 4, 4, 16, dtype=torch.long)
    for sc in range(S):
        for q in range(4):
            for w in range(4):
                kk[sc, q, w] = (256 * sc + 64 * q + 32 * (w // 2) + 8 * ((col % 8) // 2) + 4 * (w % 2)
                                + 2 * (col // 8) + col % 2)
    xb = x.double()[:, kk]  # N S q w 16
    part = torch.einsum("etsqwrk,nsqwk->etsqwrn", A, xb)  # per k-step sums
    blk = part.view(E, T, S, 4, 2, 2, 16, -1).sum(5)  # E T S q b row n: a block's two k-steps
    sb = d[..., WBYTES:].view(E, T, S, 8, 2, 8)  # g r m
    bits = ((sb << 23) & 0x7F800000).to(torch.int32)
    scale = bits.view(torch.float32).double()  # E T S g r m
    sc_row = scale.permute(0, 1, 2, 5, 4, 3).reshape(E, T, S, 8, 16)  # E T S m row (row = 8 r + g)
    y = (blk.reshape(E, T, S, 8, 16, -1) * sc_row[..., None]).sum((2, 3)) * 2.0 ** 14  # E T row n
    return y.reshape(E, R, -1)
