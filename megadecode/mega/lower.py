"""Lowering: a decode plan (qwen3_moe or deepseek_v3) to megakernel instructions for one batch size.

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
  final:   lm_head MATVEC (final norm fused), then SAMPLE per sequence when the step samples.

Activations are fp32 in the arena (the residual stream `hidden` included); weights and caches stay in the
model's dtype. Dependencies are whole-phase waits (every producer of the previous phase), which the pyvm checks
cover: a consumer's data is written by instructions that happen before it.
"""

from __future__ import annotations

import math

import torch

from ..plan import build_plan
from ..reference.rope import inv_freq_and_scale
from .isa import (
    F_GREEDY,
    F_INTERLEAVED,
    F_NORM,
    F_RENORM,
    F_RESID,
    F_SHARED,
    F_SIGMOID,
    F_WRITE_NORMED,
    Instr,
    Wait,
    f32_bits,
)
from .program import Program, Tensor

FAMILIES = ("qwen3_moe", "deepseek_v3")
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
               x_cols: int | None = None):
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
                     normed_off=self.f32[write_normed][0] if write_normed else -1)
            ins.prefetch = self.range16(w, r0 * K, (r1 - r0) * K)

    def glu(self, layer: int, name: str, wg: str, wu: str, x: str, out: str, norm: str | None):
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
                     out_col=0, r0=r0, r1=r1, B=self.B, norm_w=self.t(norm) if norm else -1, eps_bits=self.eps)
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


def lower(cfg, weights: dict, cache, batch: int, num_ctas: int = 132, sample: str | None = None) -> Program:
    """The instructions of one decode step of `batch` sequences. `sample`: None (logits only), "greedy" or
    "temperature" (a SAMPLE instruction per sequence after the lm_head)."""
    why = supports(cfg, batch)
    if why:
        raise Unsupported(f"the mega executor does not support {why}")
    b = _Builder(cfg, weights, cache, batch, num_ctas, sample)
    B, D = batch, cfg.hidden_size
    b.buf("tokens", B, ints=True)
    b.buf("positions", B, ints=True)
    b.buf("slots", B, ints=True)
    b.buf("hidden", B * D)
    rope_inv, att = inv_freq_and_scale(cfg.rope, cfg.rope_dim)
    b.aux("rope.inv_freq", rope_inv.to(next(iter(weights.values())).device))
    att_bits = f32_bits(att)
    cols = max(1, b.rows_per_tile(D, per=1.0))
    for c0 in range(0, D, cols):
        b.add("EMBED", -1, f"embed[{c0}]", bytes_=B * min(cols, D - c0) * b.wbytes, w=b.t("model.embed_tokens.weight"),
              tok_off=b.i32["tokens"][0], out_off=b.f32["hidden"][0], D=D, B=B, c0=c0, c1=min(D, c0 + cols))
    b.close("embed")
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        if cfg.family == "qwen3_moe":
            _gqa_layer(b, i, p, att_bits)
        else:
            _mla_layer(b, i, p, att_bits)
        if cfg.moe_layers[i]:
            _moe_layer(b, i, p)
        else:
            _dense_layer(b, i, p)
    V = cfg.vocab_size
    b.buf("logits", B * V)
    lm = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    b.matvec(-1, "lm_head", lm, "hidden", "logits", norm="model.norm.weight", rows=b.rows_per_tile(V, per=4.0))
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


def _gqa_layer(b: _Builder, i: int, p: str, att_bits: int) -> None:
    cfg, B = b.cfg, b.B
    H, KH, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    a = f"{p}.self_attn"
    b.buf("qkv", B * (H + 2 * KH) * d)
    for w, col in ((f"{a}.q_proj.weight", 0), (f"{a}.k_proj.weight", H * d), (f"{a}.v_proj.weight", (H + KH) * d)):
        b.matvec(i, w.split(".")[-2], w, "hidden", "qkv", col, norm=f"{p}.input_layernorm.weight",
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
                  out_stride=H * d, b=s_, h=h, S=S, H=H, d=d, wuv=-1, dv=d, P=0)
    b.close(f"L{i}.merge")
    b.matvec(i, "o_proj", f"{a}.o_proj.weight", "attn", "hidden", resid=True)
    b.close(f"L{i}.o_proj")


def _rope_flags(cfg) -> int:
    return F_INTERLEAVED if cfg.rope_interleave else 0


def _mla_layer(b: _Builder, i: int, p: str, att_bits: int) -> None:
    cfg, B = b.cfg, b.B
    H, C, R, P, V = cfg.num_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
    a = f"{p}.self_attn"
    b.buf("kva", B * (C + R))
    b.buf("qb", B * H * (P + R))
    norm = f"{p}.input_layernorm.weight"
    if cfg.q_lora_rank is None:
        b.matvec(i, "q_proj", f"{a}.q_proj.weight", "hidden", "qb", norm=norm)
    else:
        b.buf("qa", B * cfg.q_lora_rank)
        b.matvec(i, "q_a_proj", f"{a}.q_a_proj.weight", "hidden", "qa", norm=norm)
    b.matvec(i, "kv_a_proj", f"{a}.kv_a_proj_with_mqa.weight", "hidden", "kva", norm=norm)
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
                  out_off=b.f32["attn"][0], out_stride=H * V, b=s_, h=h, S=S, H=H, d=C, wuv=wkv, dv=V, P=P)
    b.close(f"L{i}.merge")
    b.matvec(i, "o_proj", f"{a}.o_proj.weight", "attn", "hidden", resid=True)
    b.close(f"L{i}.o_proj")


def _dense_layer(b: _Builder, i: int, p: str) -> None:
    cfg, B = b.cfg, b.B
    m = f"{p}.mlp"
    b.buf("mlp_h", B * cfg.intermediate_size)
    b.glu(i, "gate_up", f"{m}.gate_proj.weight", f"{m}.up_proj.weight", "hidden", "mlp_h",
          norm=f"{p}.post_attention_layernorm.weight")
    b.close(f"L{i}.mlp_up")
    b.matvec(i, "mlp_down", f"{m}.down_proj.weight", "mlp_h", "hidden", resid=True)
    b.close(f"L{i}.mlp_down")


def expected_experts(E: int, A: int, B: int) -> float:
    """Distinct experts a batch of B tokens selects, if picks were uniform: the cost model's estimate."""
    return E * (1 - (1 - A / E) ** B)


def _moe_layer(b: _Builder, i: int, p: str) -> None:
    cfg, B, D = b.cfg, b.B, b.cfg.hidden_size
    E, A, I = cfg.num_experts, cfg.top_k, cfg.moe_intermediate_size
    m = f"{p}.mlp"
    post = f"{p}.post_attention_layernorm.weight"
    b.buf("router_logits", B * E)
    b.buf("normed", B * D)
    b.matvec(i, "router", f"{m}.gate.weight", "hidden", "router_logits", norm=post, write_normed="normed",
             rows=max(1, b.rows_per_tile(E, per=0.5)))
    shared = cfg.n_shared_experts > 0
    if shared:
        S = cfg.shared_intermediate_size
        b.buf("shared_h", B * S)
        b.glu(i, "shared_up", f"{m}.shared_experts.gate_proj.weight", f"{m}.shared_experts.up_proj.weight",
              "hidden", "shared_h", norm=post)
    b.close(f"L{i}.router")
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
        b.buf("shared_out", B * D)
        b.matvec(i, "shared_down", f"{m}.shared_experts.down_proj.weight", "shared_h", "shared_out")
    b.close(f"L{i}.route")
    b.buf("h", B * A * I)
    b.buf("y", B * A * D)
    sel = expected_experts(E, A, B)
    rows = max(1, min(I, math.ceil(I * sel / b.ctas)))  # ~1 work item per CTA
    W = max(1, min(b.ctas, math.ceil(sel) * -(-I // rows)))
    per_item = 2 * rows * D * b.wbytes
    gu = b.t(f"{m}.experts.gate_up_proj")
    for w in range(W):
        b.add("EXPERT_UP", i, f"L{i}.up[{w}]", bytes_=int(per_item * sel * -(-I // rows) / W), gu=gu, I=I, D=D,
              x_off=b.f32["normed"][0], h_off=b.f32["h"][0], rows=rows, w=w, W=W, nuniq_off=b.i32["nuniq"][0],
              uniq_off=b.i32["uniq"][0], pstart_off=b.i32["pstart"][0], ptok_off=b.i32["ptok"][0])
    b.close(f"L{i}.up")
    rows = b.rows_per_tile(D)
    dn = b.t(f"{m}.experts.down_proj")
    for r0 in range(0, D, rows):
        r1 = min(D, r0 + rows)
        b.add("EXPERT_DOWN", i, f"L{i}.down[{r0}:{r1}]", F_SHARED if shared else 0,
              bytes_=int(sel * (r1 - r0) * I * b.wbytes), dn=dn, I=I, D=D, h_off=b.f32["h"][0],
              y_off=b.f32["y"][0], out_off=b.f32["hidden"][0], r0=r0, r1=r1, B=B, A=A, nuniq_off=b.i32["nuniq"][0],
              uniq_off=b.i32["uniq"][0], pstart_off=b.i32["pstart"][0], wts_off=b.f32["wts"][0],
              pairof_off=b.i32["pairof"][0], shared_off=b.f32["shared_out"][0] if shared else -1)
    b.close(f"L{i}.down")


def check_plan(plan, cfg) -> None:
    """The mega executor lowers the plan `build_plan` makes for the config; a rewritten plan is refused."""
    if plan.ops != build_plan(cfg).ops:
        raise Unsupported("the mega executor lowers the plan build_plan(cfg) makes; this plan differs")
