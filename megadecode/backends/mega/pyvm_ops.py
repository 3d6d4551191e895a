"""What pyvm's opcode semantics share (each opcode's own is `run` in its module, ops/): plain torch, fp32
activations, weights and caches in their dtype, keys and latents read back rounded to the cache dtype. `PyVM`
(pyvm.py) owns the arena, the counters, the schedule and the access records these go through (`rf`/`wf` for
floats, `ri`/`wi` for ints, `cache_row`); `VMOps` holds the helpers several opcodes read their inputs and weights
with."""

from __future__ import annotations

import torch

from ...quant.mxfp4 import MXFP4Tensor
from ...quant.mxfp4_frag import KREC, MXFP4Frag, restore
from ...reference.rope import apply_rope
from .isa import FRAG_TILE, F_FRAG, F_MXFP4, F_NORM, F_TC, bits_f32, tc_input


def mix32(seed: torch.Tensor | int, b: int, v: torch.Tensor) -> torch.Tensor:
    """A 32-bit hash of (seed, sequence, vocabulary index) -> uint32 values in int64 (the Gumbel noise source)."""
    m = 0xFFFFFFFF
    x = (int(seed) * 0x9E3779B1 + b * 0x85EBCA77 + v.long() * 0xC2B2AE3D) & m
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & m
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & m
    return x ^ (x >> 16)


def gumbel(seed: int, b: int, V: int, device) -> torch.Tensor:
    u = ((mix32(seed, b, torch.arange(V, device=device)) >> 8).float() + 0.5) / 16777216.0
    return -torch.log(-torch.log(u))


def rope(x: torch.Tensor, pos: int, inv: torch.Tensor, att: float, interleaved: bool) -> torch.Tensor:
    """Rotate x [..., dim] (fp32) by position `pos`: cos/sin = cos/sin(pos * inv) * att."""
    freqs = float(pos) * inv.float()
    c, s = freqs.cos() * att, freqs.sin() * att
    d = x.shape[-1]
    return apply_rope(x.reshape(1, -1, d), c[None], s[None], interleaved).reshape(x.shape)


def rms(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y * w.float() if w is not None else y


class VMOps:
    """The opcodes' shared helpers, mixed into PyVM (ops/*.py's `run(vm, ins, a)` call them on the vm)."""

    def rows_in(self, a) -> torch.Tensor:
        B, K = a["B"], a["K"]
        x = torch.stack([self.rf(a["x_off"] + t * a["x_stride"], K) for t in range(B)])
        if a.get("x2_off", -1) >= 0:  # the input is the sum of two buffers (kimi_k3: layer_in + attn_out)
            x = x + torch.stack([self.rf(a["x2_off"] + t * a["x_stride"], K) for t in range(B)])
        return x

    def normed(self, ins, a) -> torch.Tensor:
        x = self.rows_in(a)
        if ins.flags & F_NORM:
            x = rms(x, self.T[a["norm_w"]], bits_f32(a["eps_bits"]))
        return x

    def write_rows(self, a, y: torch.Tensor, resid: bool) -> None:
        n = y.shape[1]
        for t in range(a["B"]):
            col = t * a["out_stride"] + a["out_col"] + a["r0"]
            y_t = y[t]
            for add in ("add0_off", "add1_off"):  # addends laid out like the output
                if a.get(add, -1) >= 0:
                    y_t = y_t + self.rf(a[add] + col, n)
            if resid:
                y_t = self.rf(a["out_off"] + col, n) + y_t
            self.wf(a["out_off"] + col, y_t)

    def rows_times(self, ins, a, w: torch.Tensor) -> torch.Tensor:
        """The instruction's input rows times the weight rows w (its [r0, r1) slice): in fp32 after the norm, or
        under F_TC as the tensor-core loop computes them, the input (times the norm weight) as bf16 pairs hi + lo
        (isa.tc_input), the rstd applied to the sums."""
        if not ins.flags & F_TC:
            return self.normed(ins, a) @ w.float().T
        x = self.rows_in(a)
        if not ins.flags & F_NORM:
            return tc_input(x) @ w.float().T
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + bits_f32(a["eps_bits"]))
        return (tc_input(x, self.T[a["norm_w"]]) @ w.float().T) * rstd

    def groups(self, a):
        n = int(self.ri(a["nuniq_off"], 1))
        uniq = self.ri(a["uniq_off"], n).tolist()
        pstart = self.ri(a["pstart_off"], n + 1).tolist()
        return n, uniq, pstart

    def rows_of(self, ins, w: int, s: int, e: int, r0: int, r1: int) -> torch.Tensor:
        """Rows [r0, r1) of expert e's weight (table entry w; MXFP4: packed w + scales s, decoded exactly; F_FRAG:
        the records under w, restored to the checkpoint's order first)."""
        if ins.flags & F_FRAG:
            rec = self.T[w][e:e + 1]
            f = MXFP4Frag(rec, torch.Size((1, rec.shape[1] * FRAG_TILE, rec.shape[2] * KREC)))
            return restore(f).dequantize(torch.float32)[0, r0:r1]
        if ins.flags & F_MXFP4:
            return MXFP4Tensor(self.T[w][e, r0:r1], self.T[s][e, r0:r1]).dequantize(torch.float32)
        return self.T[w][e, r0:r1].float()








