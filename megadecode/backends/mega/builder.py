"""The lowering's builder: the tensor table, the arenas' buffers, the instructions and their phases (lower.py and
layers.py write through it)."""

from __future__ import annotations

import math

import torch

from .isa import F_NORM, F_RESID, F_TC, F_WRITE_NORMED, TC_K, Instr, Wait, f32_bits
from .program import Tensor


# Rows per MATVEC instruction at least: one pair per warp (the kernel's 8 warps take 2 rows each; GLU 1 row of
# gate and up each). A 1-row instruction keeps 7 of 8 warps idle and pays the fixed costs (wait, norm, barriers,
# signal) per row: K3's 128-row KDA projections as 128 instructions take 18 us each on the H200.
MIN_ROWS = 16
# At batch 1, 8: the kernel splits an instruction's columns over the warps its row pairs leave free (cute/dense.py
# op_rows, slices of >= 1024 columns), so an 8-row tile keeps every warp busy with half the trips per warp, and a
# phase of 2048 rows (qwen3-30b-a3b's o_proj) takes 256 CTAs instead of 128 (on 128 CTAs, 8.4 us an instruction on
# the H200)
MIN_ROWS_B1 = 8


class Builder:
    """Collects a lowering's instructions, tensor table, arena buffers and phases (one per counter)."""

    def __init__(self, cfg, weights: dict, cache, batch: int, num_ctas: int, sample: str | None,
                 causal_rows: bool = False):
        self.cfg, self.B, self.ctas, self.sample = cfg, batch, num_ctas, sample
        self.causal_rows = causal_rows  # rows may continue one sequence (lower's `causal_rows`)
        self.instrs: list[Instr] = []
        self.tensors: list[Tensor] = []
        self._tidx: dict[str, int] = {}
        self.f32: dict[str, tuple[int, int]] = {}
        self.i32: dict[str, tuple[int, int]] = {}
        self.counter = 1  # counter 0: the launch number
        self.phases: list[str] = []
        self.prev: Wait | None = None  # the wait on the phase just closed
        self.cur: list[Instr] = []
        self.weights, self.cache = weights, cache
        self.eps = f32_bits(cfg.rms_norm_eps)
        self.wbytes = next(iter(weights.values())).element_size()

    # ---- tables ---------------------------------------------------------------------------------
    def t(self, name: str, role: str = "static") -> int:
        if name not in self._tidx:
            src = self.weights if role == "static" else None
            tensor = src[name] if src is not None else self._cache_part(name)
            self._tidx[name] = len(self.tensors)
            self.tensors.append(Tensor(name, tensor, role))
        return self._tidx[name]

    def _cache_part(self, name: str) -> torch.Tensor:
        layer, part = name.rsplit(".", 1)  # cache.{i}.{part}
        return self.cache[layer][int(part)]

    def aux(self, name: str, tensor: torch.Tensor) -> int:
        """A static tensor made here (RoPE inverse frequencies)."""
        if name not in self._tidx:
            self._tidx[name] = len(self.tensors)
            self.tensors.append(Tensor(name, tensor, "static"))
        return self._tidx[name]

    def view(self, name: str, parent: str, offset: int, size: int) -> int:
        """A named piece of an fp32 buffer (kimi_k3's blocks: one buffer, so AttnRes reads them as a run)."""
        off, n = self.f32[parent]
        assert offset + size <= n, (name, parent, offset, size, n)
        self.f32[name] = (off + offset, size)
        return off + offset

    def buf(self, name: str, size: int, ints: bool = False) -> int:
        table = self.i32 if ints else self.f32
        if name not in table:
            off = max((o + n for o, n in table.values()), default=0)
            off = -(-off // 4) * 4  # 16-byte aligned starts
            table[name] = (off, size)
        assert table[name][1] == size, (name, table[name], size)
        return table[name][0]

    # ---- phases ---------------------------------------------------------------------------------
    def add(self, op: str, layer: int, name: str, flags: int = 0, bytes_: int = 0, flops: int = 0,
            extra_wait: Wait | None = None, **args) -> Instr:
        ins = Instr(op, layer, {k: int(v) for k, v in args.items()}, flags=flags, bytes=bytes_, flops=flops,
                    name=name)
        if self.prev is not None:
            ins.waits.append(self.prev)
        if extra_wait is not None:
            ins.waits.append(extra_wait)
        self.cur.append(ins)
        return ins

    def close(self, phase: str) -> Wait:
        c = self.counter
        self.counter += 1
        for ins in self.cur:
            ins.signal = c
        self.instrs += self.cur
        self.phases.append(phase)
        self.prev = Wait(c, len(self.cur), len(self.cur))
        self.cur = []
        return self.prev

    # ---- tiling ---------------------------------------------------------------------------------
    def rows_per_tile(self, total_rows: int, per: float = 1.0) -> int:
        """Rows per MATVEC tile so that a phase of `total_rows` makes about `per` instructions per CTA (one: every
        instruction has a fixed cost, the wait, two block barriers and the signal)."""
        return max(1, math.ceil(total_rows / max(1, int(per * self.ctas))))

    def phase_rows(self, parts: list[tuple[int, int]]) -> list[int]:
        """Rows per tile of ops that share a phase, each given as (rows, weight bytes a row): instructions of about
        equal bytes, as many as the CTAs in all, each op's count in proportion to its bytes (at least one). Each op
        sized alone (rows_per_tile) makes one instruction a CTA an op: K3's router phase (the shared experts' GLU,
        latent_down and the router) then ran 499 instructions on 264 CTAs, the GLU's 131 each 6x the bytes of a
        latent_down tile and the phase as long as they (k3-mini on the H200: 86 / 136 us a layer at batch 1 / 8 for
        240 MB; 66 / 118 us tiled jointly, docs/megakernel.md)."""
        total = sum(n * rb for n, rb in parts)
        counts = [max(1, min(n, int(self.ctas * n * rb / total))) for n, rb in parts]
        by_bytes = sorted(range(len(parts)), key=lambda j: -parts[j][0] * parts[j][1])
        for j in by_bytes:  # an op given one instruction for want of bytes leaves the largest ones fewer
            while sum(counts) > self.ctas and counts[j] > 1:
                counts[j] -= 1
        for j in by_bytes:  # CTAs left by the rounding down go to the largest ops
            if sum(counts) >= self.ctas:
                break
            counts[j] = min(parts[j][0], counts[j] + self.ctas - sum(counts))
        return [-(-n // c) for (n, _), c in zip(parts, counts)]

    def matvec(self, layer: int, name: str, w: str, x: str, out: str, out_col: int = 0, *, norm: str | None = None,
               resid: bool = False, write_normed: str | None = None, rows: int | None = None,
               x2: str | None = None, add0: str | None = None, add1: str | None = None, chunk_tokens: int = 0):
        """MATVEC tiles of `rows` rows of w over the batch. `chunk_tokens` > 0, for rows too few to give the CTAs
        work (the router's 128 rows are 8 tiles): each tile once per chunk of about that many of the batch's tokens,
        as many chunks as leave half the CTAs a tile each at most (near-equal chunks of consecutive tokens: x, x2,
        out, add0, add1 and the normed rows, K a token, offset by the chunk's first token)."""
        W = self.weights[w]
        N, K = W.shape
        xo, xs = self.f32[x][0], self.f32[x][1] // self.B
        oo, os_ = self.f32[out][0], self.f32[out][1] // self.B
        rows = max(rows or self.rows_per_tile(N), min(N, MIN_ROWS_B1 if self.B == 1 else MIN_ROWS))
        flags = (F_NORM if norm else 0) | (F_RESID if resid else 0) | (F_WRITE_NORMED if write_normed else 0)
        flags |= self.tc(K, w)
        nc = 1
        if chunk_tokens > 0:
            nc = min(-(-self.B // chunk_tokens), self.ctas // (2 * -(-N // rows)))
            nc = max(1, min(nc, self.B // 2 if flags & F_TC else self.B))  # F_TC: 2 tokens a chunk or more
        bounds = [self.B * c // nc for c in range(nc + 1)]
        for t0, t1 in zip(bounds, bounds[1:]):
            def at(off: int, stride: int) -> int:  # an offset at the chunk's first token (-1: none)
                return off + t0 * stride if off >= 0 else -1

            for r0 in range(0, N, rows):
                r1 = min(N, r0 + rows)
                tag = f"[{r0}:{r1}]" if nc == 1 else f"[{r0}:{r1}, t{t0}:{t1}]"
                ins = self.add("MATVEC", layer, f"L{layer}.{name}{tag}", flags,
                               bytes_=(r1 - r0) * K * self.wbytes, flops=2 * (r1 - r0) * K * (t1 - t0),
                               w=self.t(w), K=K, x_off=xo + t0 * xs, x_stride=xs, out_off=oo + t0 * os_,
                               out_stride=os_, out_col=out_col, r0=r0, r1=r1, B=t1 - t0,
                               norm_w=self.t(norm) if norm else -1, eps_bits=self.eps,
                               normed_off=at(self.f32[write_normed][0], K) if write_normed else -1,
                               x2_off=at(self.off(x2), xs), add0_off=at(self.off(add0), os_),
                               add1_off=at(self.off(add1), os_))
                ins.prefetch = self.range16(w, r0 * K, (r1 - r0) * K)

    def tc(self, K: int, *weights: str) -> int:
        """F_TC for bf16 rows of K columns at this batch: the tensor-core loop from 2 tokens, where the CUDA-core
        loop issues ~0.4 instructions per weight byte a token (Nsight Compute on the H200: MATVEC's 8-token loop, 823
        SASS instructions per 2 KB of weights a warp, 43% of the step's stall samples at k3-mini batch 8). Only for
        bf16 weights (what the kernel runs): fp32 programs (pyvm's exact CPU tests) keep fp32 inputs."""
        bf16 = all(self.weights[w].dtype == torch.bfloat16 for w in weights)
        return F_TC if self.B >= 2 and K % TC_K == 0 and bf16 else 0

    def off(self, name: str | None) -> int:
        return self.f32[name][0] if name else -1

    def glu(self, layer: int, name: str, wg: str, wu: str, x: str, out: str, norm: str | None, x2: str | None = None,
            rows: int | None = None):
        Wg = self.weights[wg]
        N, K = Wg.shape
        rows = max(rows or self.rows_per_tile(2 * N), min(N, MIN_ROWS // 2))
        xo, xs = self.f32[x][0], self.f32[x][1] // self.B
        oo, os_ = self.f32[out][0], self.f32[out][1] // self.B
        for r0 in range(0, N, rows):
            r1 = min(N, r0 + rows)
            ins = self.add("GLU", layer, f"L{layer}.{name}[{r0}:{r1}]", (F_NORM if norm else 0) | self.tc(K, wg, wu),
                     bytes_=2 * (r1 - r0) * K * self.wbytes, flops=4 * (r1 - r0) * K * self.B,
                     wg=self.t(wg), wu=self.t(wu), K=K, x_off=xo, x_stride=xs, out_off=oo, out_stride=os_,
                     out_col=0, r0=r0, r1=r1, B=self.B, norm_w=self.t(norm) if norm else -1, eps_bits=self.eps,
                     x2_off=self.off(x2))
            ins.prefetch = self.range16(wg, r0 * K, (r1 - r0) * K)  # the up rows: the kernel's own loads

    def range16(self, w: str, first: int, count: int) -> tuple[int, int, int]:
        """(tensor, byte offset, bytes) of elements [first, first + count) of weight w, widened to 16-byte units."""
        es = self.weights[w].element_size()
        lo, hi = first * es // 16 * 16, -(-(first + count) * es // 16) * 16
        return (self.t(w), lo, hi - lo)

    def splits(self, units: int) -> int:
        """Splits of the cache length per attention unit: about one instruction per CTA in all, and no more
        splits than the cache holds 64-position pieces (the kernel's chunk; the length is only known in the launch).
        At most 64: with up to 256, K3's MLA layer at 1024 cached positions runs 48 instructions on 264 CTAs, 262 us
        each (H200)."""
        return max(1, min(64, self.cache.max_len // 64, round(self.ctas / max(1, units))))
