"""Lowering: a decode plan (qwen3_moe, deepseek_v3, kimi_k3) to megakernel instructions for one batch size.

Each plan op becomes one or more phases; a phase is a set of instructions that wait on the previous phase's
counter and signal their own. Ops are split into tiles so that every CTA streams weights at once:

  qwen3_moe layer                            deepseek_v3 layer
  qkv      MATVEC x3 (input norm fused)      qa_kva   MATVEC q_a, kv_a (input norm fused)
  attn     ATTN_GQA (b, kv head, split)      qb_kv    MATVEC q_b (q_a norm fused), MLA_KV (b)
  merge    MERGE (b, head)                   q        MLA_Q (b, head): W_UK absorbed, q_pe rotated
  o_proj   MATVEC, residual add fused        attn     MLA_ATTN (b, head block, split)
  router   MATVEC (post-attention norm       merge    MERGE (b, head), W_UV applied
           fused; writes the normed rows)    o_proj   MATVEC, residual add fused
  route    ROUTE (one instruction)           router   MATVEC + shared experts' GLU
  up       EXPERT_UP (work-balanced)         route    ROUTE, shared experts' down MATVEC
  down     EXPERT_DOWN (row tiles over       up, down as qwen3_moe; down adds the shared output
           every selected expert; combine
           and residual add fused)
  dense layers: GLU (norm fused), then MATVEC down with the residual add.
  kimi_k3 layer: ATTN_RES (the layer input from the blocks' sums); KDA (projections, low-rank gates, KDA_STEP per
           (b, head): conv step, gates, the recurrence on the fp32 state, gated RMSNorm; o_proj) or gated NoPE MLA;
           LatentMoE (router + shared experts' GLU + latent down, ROUTE + shared down, MXFP4 SiTU experts in the
           latent width, the weighted sum stored, latent up with the latent norm fused, adding the shared and
           attention outputs to the block's partial sum).
  final:   lm_head MATVEC (final norm fused), then SAMPLE per sequence when the step samples.

Activations are fp32 in the arena (the residual stream `hidden` included); weights and caches stay in the
model's dtype. Dependencies are whole-phase waits (every producer of the previous phase), which the pyvm checks
cover: a consumer's data is written by instructions that happen before it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..plan import build_plan
from ..reference.rope import inv_freq_and_scale
from .isa import (
    F_GREEDY,
    F_INTERLEAVED,
    F_MXFP4,
    F_NOPE,
    F_NORM,
    F_RENORM,
    F_RESID,
    F_SHARED,
    F_SIGMOID,
    F_SITU,
    F_STORE,
    F_WRITE_NORMED,
    Instr,
    Wait,
    f32_bits,
)
from .program import Program, Tensor

FAMILIES = ("qwen3_moe", "deepseek_v3", "kimi_k3")
MAX_BATCH = 64
MAX_ATTN_CHUNK = 64  # positions an attention instruction scores at a time (its shared-memory tile)


class Unsupported(ValueError):
    """The megakernel cannot run this model or batch, and why."""


def supports(cfg, batch: int) -> str | None:
    if cfg.family not in FAMILIES:
        return f"family {cfg.family} (the megakernel lowers {', '.join(FAMILIES)})"
    if not 1 <= batch <= MAX_BATCH:
        return f"batch {batch} outside 1..{MAX_BATCH}"
    if cfg.family == "deepseek_v3" and not cfg.mla_rope:
        return "MLA without rope"
    if cfg.family == "kimi_k3" and any(not m for m in cfg.moe_layers[1:]) and cfg.latent_size == 0:
        return "kimi_k3 without LatentMoE"
    if cfg.expert_quant == "fp8":
        return "FP8 experts (the megakernel's expert instructions read 16-bit weights)"
    if 2 * cfg.num_experts + batch * cfg.top_k > 1900:
        return (f"{cfg.num_experts} experts x top-{cfg.top_k} at batch {batch} (ROUTE groups the pairs in 1900 words "
                "of shared memory)")
    return None


class _Builder:
    def __init__(self, cfg, weights: dict, cache, batch: int, num_ctas: int, sample: str | None):
        self.cfg, self.B, self.ctas, self.sample = cfg, batch, num_ctas, sample
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

    def matvec(self, layer: int, name: str, w: str, x: str, out: str, out_col: int = 0, *, norm: str | None = None,
               resid: bool = False, write_normed: str | None = None, rows: int | None = None,
               x2: str | None = None, add0: str | None = None, add1: str | None = None):
        W = self.weights[w]
        N, K = W.shape
        xo, xs = self.f32[x][0], self.f32[x][1] // self.B
        oo, os_ = self.f32[out][0], self.f32[out][1] // self.B
        rows = rows or self.rows_per_tile(N)
        flags = (F_NORM if norm else 0) | (F_RESID if resid else 0) | (F_WRITE_NORMED if write_normed else 0)
        for r0 in range(0, N, rows):
            r1 = min(N, r0 + rows)
            ins = self.add("MATVEC", layer, f"L{layer}.{name}[{r0}:{r1}]", flags,
                     bytes_=(r1 - r0) * K * self.wbytes, flops=2 * (r1 - r0) * K * self.B,
                     w=self.t(w), K=K, x_off=xo, x_stride=xs, out_off=oo, out_stride=os_, out_col=out_col, r0=r0,
                     r1=r1, B=self.B, norm_w=self.t(norm) if norm else -1, eps_bits=self.eps,
                     normed_off=self.f32[write_normed][0] if write_normed else -1, x2_off=self.off(x2),
                     add0_off=self.off(add0), add1_off=self.off(add1))
            ins.prefetch = self.range16(w, r0 * K, (r1 - r0) * K)

    def off(self, name: str | None) -> int:
        return self.f32[name][0] if name else -1

    def glu(self, layer: int, name: str, wg: str, wu: str, x: str, out: str, norm: str | None, x2: str | None = None):
        Wg = self.weights[wg]
        N, K = Wg.shape
        rows = self.rows_per_tile(2 * N)
        xo, xs = self.f32[x][0], self.f32[x][1] // self.B
        oo, os_ = self.f32[out][0], self.f32[out][1] // self.B
        for r0 in range(0, N, rows):
            r1 = min(N, r0 + rows)
            ins = self.add("GLU", layer, f"L{layer}.{name}[{r0}:{r1}]", F_NORM if norm else 0,
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
        splits than the cache holds 256-position pieces (the length is only known in the launch)."""
        return max(1, min(64, self.cache.max_len // 256, round(self.ctas / max(1, units))))


@dataclass(frozen=True)
class LayerIO:
    """Where a layer reads and writes the residual stream. qwen3_moe / deepseek_v3 (and kimi_k3 without AttnRes):
    everything is `hidden`, attention and MLP outputs added in place. kimi_k3 with AttnRes: the layer reads
    `layer_in` (the AttnRes output), attention writes `attn_out`, the MLP reads layer_in + attn_out, and its last
    projection adds attention + MLP output to the current block's partial sum (stores it at a block's first
    layer)."""
    x: str = "hidden"
    attn_out: str = "hidden"
    attn_resid: bool = True
    mlp_x2: str | None = None
    out: str = "hidden"
    out_resid: bool = True
    out_adds: tuple[str, ...] = ()


def lower(cfg, weights: dict, cache, batch: int, num_ctas: int = 132, sample: str | None = None) -> Program:
    """The instructions of one decode step of `batch` sequences. `sample`: None (logits only), "greedy" or
    "temperature" (a SAMPLE instruction per sequence after the lm_head)."""
    why = supports(cfg, batch)
    if why:
        raise Unsupported(f"the mega executor does not support {why}")
    b = _Builder(cfg, weights, cache, batch, num_ctas, sample)
    B, D, L = batch, cfg.hidden_size, cfg.num_layers
    b.buf("tokens", B, ints=True)
    b.buf("positions", B, ints=True)
    b.buf("slots", B, ints=True)
    Bsz = cfg.attn_res_block_size if cfg.family == "kimi_k3" else 0
    nblocks = (L - 1) // Bsz + 1 if Bsz else 1
    b.buf("blocks", nblocks * B * D)
    for k in range(nblocks):
        b.view(f"block{k}", "blocks", k * B * D, B * D)
    b.view("hidden", "blocks", 0, B * D)
    rope_inv, att = inv_freq_and_scale(cfg.rope, cfg.rope_dim)
    b.aux("rope.inv_freq", rope_inv.to(next(iter(weights.values())).device))
    att_bits = f32_bits(att)
    cols = max(1, b.rows_per_tile(D, per=1.0))
    for c0 in range(0, D, cols):
        b.add("EMBED", -1, f"embed[{c0}]", bytes_=B * min(cols, D - c0) * b.wbytes, w=b.t("model.embed_tokens.weight"),
              tok_off=b.i32["tokens"][0], out_off=b.f32["hidden"][0], D=D, B=B, c0=c0, c1=min(D, c0 + cols))
    b.close("embed")
    if Bsz:
        b.buf("layer_in", B * D)
        b.buf("attn_out", B * D)
    for i in range(L):
        p = f"model.layers.{i}"
        io = LayerIO()
        if Bsz:
            k, start = i // Bsz, i % Bsz == 0 and i > 0
            _attn_res(b, i, f"{p}.attn_res", k if start else k + 1)
            io = LayerIO(x="layer_in", attn_out="attn_out", attn_resid=False, mlp_x2="attn_out", out=f"block{k}",
                         out_resid=not start, out_adds=("attn_out",))
        if cfg.family == "qwen3_moe":
            _gqa_layer(b, i, p, att_bits, io)
        elif cfg.is_kda(i):
            _kda_layer(b, i, p, io)
        else:
            _mla_layer(b, i, p, att_bits, io)
        if not cfg.moe_layers[i]:
            _dense_layer(b, i, p, io)
        elif cfg.latent_size:
            _latent_moe_layer(b, i, p, io)
        else:
            _moe_layer(b, i, p, io)
    final = "hidden"
    if Bsz:
        _attn_res(b, -1, "model.attn_res", nblocks)
        final = "layer_in"
    V = cfg.vocab_size
    b.buf("logits", B * V)
    lm = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    b.matvec(-1, "lm_head", lm, final, "logits", norm="model.norm.weight", rows=b.rows_per_tile(V, per=4.0))
    b.close("lm_head")
    if sample is not None:
        b.buf("sampled", B, ints=True)
        b.buf("sampled_lp", B)
        b.buf("seed", 1, ints=True)
        for s in range(B):
            b.add("SAMPLE", -1, f"sample[{s}]", F_GREEDY if sample == "greedy" else 0, bytes_=V * 4,
                  logits_off=b.f32["logits"][0], V=V, b=s, tok_out_off=b.i32["sampled"][0],
                  lp_out_off=b.f32["sampled_lp"][0], seed_off=b.i32["seed"][0], inv_temp_bits=f32_bits(1.0))
        b.close("sample")
    prog = Program(cfg, batch, b.instrs, b.tensors, b.f32, b.i32, b.counter, b.phases)
    prog.check()
    return prog


def _attn_res(b: _Builder, i: int, prefix: str, nsrc: int) -> None:
    """kimi_k3's AttnRes into `layer_in`: the first nsrc blocks are the sources (the completed ones, plus the current
    partial sum once its block has a layer output)."""
    B, D = b.B, b.cfg.hidden_size
    cols = max(8, -(-b.rows_per_tile(D * B, per=1.0) // 8) * 8)
    for s_ in range(B):
        for c0 in range(0, D, cols):
            b.add("ATTN_RES", i, f"L{i}.attn_res[{s_},{c0}]", bytes_=nsrc * D * 4, src_off=b.f32["blocks"][0],
                  nsrc=nsrc, B=B, D=D, query_w=b.t(f"{prefix}.query"), norm_w=b.t(f"{prefix}.norm.weight"),
                  eps_bits=b.eps, out_off=b.f32["layer_in"][0], b=s_, c0=c0, c1=min(D, c0 + cols))
    b.close(f"L{i}.attn_res" if i >= 0 else "final.attn_res")


def _gqa_layer(b: _Builder, i: int, p: str, att_bits: int, io: LayerIO) -> None:
    cfg, B = b.cfg, b.B
    H, KH, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    a = f"{p}.self_attn"
    b.buf("qkv", B * (H + 2 * KH) * d)
    for w, col in ((f"{a}.q_proj.weight", 0), (f"{a}.k_proj.weight", H * d), (f"{a}.v_proj.weight", (H + KH) * d)):
        b.matvec(i, w.split(".")[-2], w, io.x, "qkv", col, norm=f"{p}.input_layernorm.weight",
                 rows=b.rows_per_tile((H + 2 * KH) * d))
    b.close(f"L{i}.qkv")
    S = b.splits(B * KH)
    b.buf("part", B * H * S * (d + 2))
    kc, vc = b.t(f"cache.{i}.0", "produced"), b.t(f"cache.{i}.1", "produced")
    for s_ in range(B):
        for h in range(KH):
            for s in range(S):
                b.add("ATTN_GQA", i, f"L{i}.attn[{s_},{h},{s}]", 0, bytes_=0, kc=kc, vc=vc,
                      qkv_off=b.f32["qkv"][0], qkv_stride=(H + 2 * KH) * d, qn_w=b.t(f"{a}.q_norm.weight"),
                      kn_w=b.t(f"{a}.k_norm.weight"), pos_off=b.i32["positions"][0], slot_off=b.i32["slots"][0],
                      b=s_, h=h, s=s, S=S, H=H, KH=KH, d=d, part_off=b.f32["part"][0],
                      scale_bits=f32_bits(d ** -0.5), eps_bits=b.eps, rope_w=b._tidx["rope.inv_freq"],
                      att_bits=att_bits, Lmax=b.cache.max_len)
    b.close(f"L{i}.attn")
    b.buf("attn", B * H * d)
    for s_ in range(B):
        for h in range(H):
            b.add("MERGE", i, f"L{i}.merge[{s_},{h}]", part_off=b.f32["part"][0], out_off=b.f32["attn"][0],
                  out_stride=H * d, b=s_, h=h, S=S, H=H, d=d, wuv=-1, dv=d, P=0, gate_off=-1)
    b.close(f"L{i}.merge")
    b.matvec(i, "o_proj", f"{a}.o_proj.weight", "attn", io.attn_out, resid=io.attn_resid)
    b.close(f"L{i}.o_proj")




def _rope_flags(cfg) -> int:
    return (F_INTERLEAVED if cfg.rope_interleave else 0) | (0 if cfg.mla_rope else F_NOPE)


def _mla_layer(b: _Builder, i: int, p: str, att_bits: int, io: LayerIO) -> None:
    cfg, B = b.cfg, b.B
    H, C, R, P, V = cfg.num_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
    a = f"{p}.self_attn"
    b.buf("kva", B * (C + R))
    b.buf("qb", B * H * (P + R))
    norm = f"{p}.input_layernorm.weight"
    if cfg.q_lora_rank is None:
        b.matvec(i, "q_proj", f"{a}.q_proj.weight", io.x, "qb", norm=norm)
    else:
        b.buf("qa", B * cfg.q_lora_rank)
        b.matvec(i, "q_a_proj", f"{a}.q_a_proj.weight", io.x, "qa", norm=norm)
    b.matvec(i, "kv_a_proj", f"{a}.kv_a_proj_with_mqa.weight", io.x, "kva", norm=norm)
    gate = None
    if cfg.mla_output_gate:  # kimi_k3: o = o_proj(attn * sigmoid(x W_gate^T)), x the normed layer input
        gate = "mla_gate"
        b.buf(gate, B * H * V)
        b.matvec(i, "gate_proj", f"{a}.gate_proj.weight", io.x, gate, norm=norm)
    b.close(f"L{i}.qa_kva")
    if cfg.q_lora_rank is not None:
        b.matvec(i, "q_b_proj", f"{a}.q_b_proj.weight", "qa", "qb", norm=f"{a}.q_a_layernorm.weight")
    cache = b.t(f"cache.{i}.0", "produced")
    for s_ in range(B):
        b.add("MLA_KV", i, f"L{i}.kv[{s_}]", _rope_flags(cfg), cache=cache, kva_off=b.f32["kva"][0],
              kva_stride=C + R, norm_w=b.t(f"{a}.kv_a_layernorm.weight"), C=C, R=R, pos_off=b.i32["positions"][0],
              slot_off=b.i32["slots"][0], b=s_, eps_bits=b.eps, rope_w=b._tidx["rope.inv_freq"], att_bits=att_bits,
              Lmax=b.cache.max_len)
    b.close(f"L{i}.qb_kv")
    b.buf("qlat", B * H * C)
    b.buf("qpe", B * H * R)
    wkv = b.t(f"{a}.kv_b_proj.weight")
    for s_ in range(B):
        for h in range(H):
            b.add("MLA_Q", i, f"L{i}.q[{s_},{h}]", _rope_flags(cfg), bytes_=P * C * b.wbytes, wkv=wkv,
                  qb_off=b.f32["qb"][0], qb_stride=H * (P + R), qlat_off=b.f32["qlat"][0], qpe_off=b.f32["qpe"][0],
                  b=s_, h=h, H=H, P=P, R=R, C=C, V=V, pos_off=b.i32["positions"][0],
                  rope_w=b._tidx["rope.inv_freq"], att_bits=att_bits)
    b.close(f"L{i}.q")
    HB = min(H, 8)  # heads per MLA attention instruction (their latent queries and outputs in shared memory)
    S = b.splits(B * -(-H // HB))
    b.buf("part", B * H * S * (C + 2))
    for s_ in range(B):
        for h0 in range(0, H, HB):
            for s in range(S):
                b.add("MLA_ATTN", i, f"L{i}.attn[{s_},{h0},{s}]", cache=cache, qlat_off=b.f32["qlat"][0],
                      qpe_off=b.f32["qpe"][0], pos_off=b.i32["positions"][0], slot_off=b.i32["slots"][0], b=s_,
                      h0=h0, HB=min(HB, H - h0), s=s, S=S, H=H, C=C, R=R, part_off=b.f32["part"][0],
                      scale_bits=f32_bits(cfg.softmax_scale), Lmax=b.cache.max_len)
    b.close(f"L{i}.attn")
    b.buf("attn", B * H * V)
    for s_ in range(B):
        for h in range(H):
            b.add("MERGE", i, f"L{i}.merge[{s_},{h}]", bytes_=V * C * b.wbytes, part_off=b.f32["part"][0],
                  out_off=b.f32["attn"][0], out_stride=H * V, b=s_, h=h, S=S, H=H, d=C, wuv=wkv, dv=V, P=P,
                  gate_off=b.off(gate))
    b.close(f"L{i}.merge")
    b.matvec(i, "o_proj", f"{a}.o_proj.weight", "attn", io.attn_out, resid=io.attn_resid)
    b.close(f"L{i}.o_proj")


def _kda_layer(b: _Builder, i: int, p: str, io: LayerIO) -> None:
    """KDA decode (reference/kda.py): the projections (input norm fused), the low-rank gate halves, one KDA_STEP
    per (sequence, head): conv step, gates, the recurrence on the slot's fp32 state, gated RMSNorm; o_proj."""
    cfg, B = b.cfg, b.B
    H, K = cfg.linear_num_heads, cfg.linear_head_dim
    HK, a, f = H * K, f"{p}.self_attn", f"{p}.self_attn.forget_gate"
    norm = f"{p}.input_layernorm.weight"
    for name, n in (("kda_qkv", 3 * HK), ("kda_fa", K), ("kda_ga", K), ("kda_beta", H), ("kda_f", HK),
                    ("kda_gate", HK), ("kda_o", HK)):
        b.buf(name, B * n)
    rows = b.rows_per_tile(3 * HK)
    for w, col in ((f"{a}.q_proj.weight", 0), (f"{a}.k_proj.weight", HK), (f"{a}.v_proj.weight", 2 * HK)):
        b.matvec(i, w.split(".")[-2], w, io.x, "kda_qkv", col, norm=norm, rows=rows)
    b.matvec(i, "f_a_proj", f"{f}.f_a_proj.weight", io.x, "kda_fa", norm=norm)
    b.matvec(i, "g_a_proj", f"{a}.g_a_proj.weight", io.x, "kda_ga", norm=norm)
    b.matvec(i, "b_proj", f"{a}.b_proj.weight", io.x, "kda_beta", norm=norm)
    b.close(f"L{i}.kda_proj")
    b.matvec(i, "f_b_proj", f"{f}.f_b_proj.weight", "kda_fa", "kda_f")
    b.matvec(i, "g_b_proj", f"{a}.g_b_proj.weight", "kda_ga", "kda_gate")
    b.close(f"L{i}.kda_gates")
    conv_state, rec_state = b.t(f"cache.{i}.0", "produced"), b.t(f"cache.{i}.1", "produced")
    for s_ in range(B):
        for h in range(H):
            b.add("KDA_STEP", i, f"L{i}.kda[{s_},{h}]", bytes_=K * K * 4 * 2, qkv_off=b.f32["kda_qkv"][0],
                  f_off=b.f32["kda_f"][0], gate_off=b.f32["kda_gate"][0], beta_off=b.f32["kda_beta"][0],
                  conv_w=b.t(f"{a}.conv1d.weight"), conv_state=conv_state, rec_state=rec_state,
                  a_log=b.t(f"{f}.A_log"), dt_bias=b.t(f"{f}.dt_bias"), onorm_w=b.t(f"{a}.o_norm.weight"),
                  out_off=b.f32["kda_o"][0], b=s_, h=h, H=H, K=K, W=cfg.conv_kernel, slot_off=b.i32["slots"][0],
                  eps_bits=b.eps)
    b.close(f"L{i}.kda")
    b.matvec(i, "o_proj", f"{a}.o_proj.weight", "kda_o", io.attn_out, resid=io.attn_resid)
    b.close(f"L{i}.o_proj")


def _dense_layer(b: _Builder, i: int, p: str, io: LayerIO) -> None:
    cfg, B = b.cfg, b.B
    m = f"{p}.mlp"
    b.buf("mlp_h", B * cfg.intermediate_size)
    b.glu(i, "gate_up", f"{m}.gate_proj.weight", f"{m}.up_proj.weight", io.x, "mlp_h",
          norm=f"{p}.post_attention_layernorm.weight", x2=io.mlp_x2)
    b.close(f"L{i}.mlp_up")
    b.matvec(i, "mlp_down", f"{m}.down_proj.weight", "mlp_h", io.out, resid=io.out_resid,
             add0=io.out_adds[0] if io.out_adds else None)
    b.close(f"L{i}.mlp_down")


def expected_experts(E: int, A: int, B: int) -> float:
    """Distinct experts a batch of B tokens selects, if picks were uniform: the cost model's estimate."""
    return E * (1 - (1 - A / E) ** B)


def _route(b: _Builder, i: int, m: str, shared: bool) -> None:
    """The router's logits (post-attention norm fused; the tile at row 0 writes the normed rows) are made by the
    caller's phase; this phase picks the experts (ROUTE) and runs the shared experts' down projection."""
    cfg, B = b.cfg, b.B
    E, A = cfg.num_experts, cfg.top_k
    for name, n in (("ids", B * A), ("nuniq", 1), ("uniq", E), ("pstart", E + 1), ("ptok", B * A),
                    ("pslot", B * A), ("pairof", B * A)):
        b.buf(name, n, ints=True)
    b.buf("wts", B * A)
    sigmoid = cfg.score_func == "sigmoid"
    bias = f"{m}.gate.e_score_correction_bias"
    b.add("ROUTE", i, f"L{i}.route", (F_SIGMOID if sigmoid else 0) | (F_RENORM if cfg.norm_topk_prob else 0),
          bytes_=B * E * 4, logits_off=b.f32["router_logits"][0], E=E, A=A, B=B,
          bias_w=b.t(bias) if sigmoid and bias in b.weights else -1, n_group=cfg.n_group, topk_group=cfg.topk_group,
          scale_bits=f32_bits(cfg.routed_scaling_factor if sigmoid else 1.0), ids_off=b.i32["ids"][0],
          wts_off=b.f32["wts"][0], nuniq_off=b.i32["nuniq"][0], uniq_off=b.i32["uniq"][0],
          pstart_off=b.i32["pstart"][0], ptok_off=b.i32["ptok"][0], pslot_off=b.i32["pslot"][0],
          pairof_off=b.i32["pairof"][0])
    if shared:
        b.buf("shared_out", B * cfg.hidden_size)
        b.matvec(i, "shared_down", f"{m}.shared_experts.down_proj.weight", "shared_h", "shared_out")
    b.close(f"L{i}.route")


def _experts(b: _Builder, i: int, m: str, D: int, x: str, out: str, flags_up: int, flags_down: int,
             shared_off: int, quant: bool) -> None:
    """EXPERT_UP (work-balanced items of (selected expert, row tile)) and EXPERT_DOWN (row tiles over every
    selected expert, the weighted combine fused) of the routed experts, D their input / output width."""
    cfg, B = b.cfg, b.B
    E, A, I = cfg.num_experts, cfg.top_k, cfg.moe_intermediate_size
    b.buf("h", B * A * I)
    b.buf("y", B * A * D)
    sel = expected_experts(E, A, B)
    rows = max(1, min(I, math.ceil(I * sel / b.ctas)))  # ~1 work item per CTA
    W = max(1, min(b.ctas, math.ceil(sel) * -(-I // rows)))
    gu_name = f"{m}.experts.gate_up_proj" + (".weight_packed" if quant else "")
    dn_name = f"{m}.experts.down_proj" + (".weight_packed" if quant else "")
    wbytes = 0.53125 if quant else b.wbytes  # MXFP4: 4.25 bits per weight
    per_item = 2 * rows * D * wbytes
    gu, gus = b.t(gu_name), b.t(f"{m}.experts.gate_up_proj.weight_scale") if quant else -1
    for w in range(W):
        b.add("EXPERT_UP", i, f"L{i}.up[{w}]", flags_up, bytes_=int(per_item * sel * -(-I // rows) / W), gu=gu, I=I,
              D=D, x_off=b.f32[x][0], h_off=b.f32["h"][0], rows=rows, w=w, W=W, nuniq_off=b.i32["nuniq"][0],
              uniq_off=b.i32["uniq"][0], pstart_off=b.i32["pstart"][0], ptok_off=b.i32["ptok"][0], gus=gus)
    b.close(f"L{i}.up")
    rows = b.rows_per_tile(D)
    dn, dns = b.t(dn_name), b.t(f"{m}.experts.down_proj.weight_scale") if quant else -1
    for r0 in range(0, D, rows):
        r1 = min(D, r0 + rows)
        b.add("EXPERT_DOWN", i, f"L{i}.down[{r0}:{r1}]", flags_down, bytes_=int(sel * (r1 - r0) * I * wbytes),
              dn=dn, I=I, D=D, h_off=b.f32["h"][0], y_off=b.f32["y"][0], out_off=b.f32[out][0], r0=r0, r1=r1, B=B,
              A=A, nuniq_off=b.i32["nuniq"][0], uniq_off=b.i32["uniq"][0], pstart_off=b.i32["pstart"][0],
              wts_off=b.f32["wts"][0], pairof_off=b.i32["pairof"][0], shared_off=shared_off, dns=dns)
    b.close(f"L{i}.down")


def _moe_layer(b: _Builder, i: int, p: str, io: LayerIO) -> None:
    cfg, B, D = b.cfg, b.B, b.cfg.hidden_size
    m = f"{p}.mlp"
    post = f"{p}.post_attention_layernorm.weight"
    b.buf("router_logits", B * cfg.num_experts)
    b.buf("normed", B * D)
    b.matvec(i, "router", f"{m}.gate.weight", io.x, "router_logits", norm=post, write_normed="normed",
             rows=max(1, b.rows_per_tile(cfg.num_experts, per=0.5)), x2=io.mlp_x2)
    shared = cfg.n_shared_experts > 0
    if shared:
        b.buf("shared_h", B * cfg.shared_intermediate_size)
        b.glu(i, "shared_up", f"{m}.shared_experts.gate_proj.weight", f"{m}.shared_experts.up_proj.weight",
              io.x, "shared_h", norm=post, x2=io.mlp_x2)
    b.close(f"L{i}.router")
    _route(b, i, m, shared)
    _experts(b, i, m, D, "normed", io.out, 0, F_SHARED if shared else 0,
             b.f32["shared_out"][0] if shared else -1, quant=False)


def _latent_moe_layer(b: _Builder, i: int, p: str, io: LayerIO) -> None:
    """kimi_k3's Stable LatentMoE (reference/latent_moe.py): router, shared experts and latent down on the
    post-attention normed input; MXFP4 SiTU-GLU experts in the latent width; the weighted sum `z` stored; latent
    up with the latent RMSNorm fused, adding the shared experts' and the attention's outputs to the block."""
    cfg, B, D, R = b.cfg, b.B, b.cfg.hidden_size, b.cfg.latent_size
    m = f"{p}.mlp"
    post = f"{p}.post_attention_layernorm.weight"
    b.buf("router_logits", B * cfg.num_experts)
    b.buf("normed", B * D)
    b.buf("hlat", B * R)
    b.buf("z", B * R)
    b.matvec(i, "router", f"{m}.gate.weight", io.x, "router_logits", norm=post, write_normed="normed",
             rows=max(1, b.rows_per_tile(cfg.num_experts, per=0.5)), x2=io.mlp_x2)
    b.buf("shared_h", B * cfg.shared_intermediate_size)
    b.glu(i, "shared_up", f"{m}.shared_experts.gate_proj.weight", f"{m}.shared_experts.up_proj.weight", io.x,
          "shared_h", norm=post, x2=io.mlp_x2)
    b.matvec(i, "latent_down", f"{m}.latent_down.weight", io.x, "hlat", norm=post, x2=io.mlp_x2)
    b.close(f"L{i}.router")
    _route(b, i, m, shared=True)
    act = F_SITU if cfg.expert_act == "situ" else 0
    _experts(b, i, m, R, "hlat", "z", F_MXFP4 | act, F_MXFP4 | F_STORE, -1, quant=True)
    b.matvec(i, "latent_up", f"{m}.latent_up.weight", "z", io.out, norm=f"{m}.latent_norm.weight",
             resid=io.out_resid, add0="shared_out", add1=io.out_adds[0] if io.out_adds else None)
    b.close(f"L{i}.latent_up")


def check_plan(plan, cfg) -> None:
    """The mega executor lowers the plan `build_plan` makes for the config; a rewritten plan is refused."""
    if plan.ops != build_plan(cfg).ops:
        raise Unsupported("the mega executor lowers the plan build_plan(cfg) makes; this plan differs")
