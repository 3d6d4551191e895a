"""The layers of the lowering (lower.py): each writes one layer's phases into the builder. Which buffers a layer
reads and writes in the residual stream is a LayerIO (plain residual families, or kimi_k3's AttnRes blocks).

    gqa_layer         qkv (input norm fused), ATTN_GQA splits, MERGE, o_proj
    mla_layer         q_a / kv_a (+ K3's output gate), q_b + MLA_KV, MLA_Q, MLA_ATTN splits, MERGE (W_UV), o_proj
    kda_layer         projections, low-rank gates, KDA_STEP per (sequence, head), o_proj
    dense_layer       GLU (post-attention norm fused), down with the residual add
    moe_layer         router (+ shared GLU), ROUTE (+ shared down), EXPERT_UP, EXPERT_DOWN (combine fused)
    latent_moe_layer  kimi_k3's LatentMoE: latent down, MXFP4 SiTU experts in the latent width (fragment order:
                      EXPERT_DOWN pair-major, then COMBINE), latent up
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...quant.mxfp4_frag import is_frag_entry
from .builder import Builder
from .limits import NT
from .isa import (
    FRAG_DOWN,
    FRAG_TILE,
    F_FRAG,
    F_GROUP,
    F_INTERLEAVED,
    F_KV_READ,
    F_KV_WRITE,
    F_MXFP4,
    F_NOPE,
    F_PAIR1,
    F_PICKS,
    F_RENORM,
    F_ROUTE,
    F_SHARED,
    F_SIGMOID,
    F_SITU,
    F_STORE,
    F_TABLES,
    GROUP_MAX_E,
    GROUP_MIN_B,
    GROUP_N,
    GROUP_TILE,
    PAIR1_MAX_B,
    ROUTE_IN_UP_MAX_B,
    ROUTE_SPLIT_B,
    ROUTE_TOKENS,
    TC_K,
    f32_bits,
)


WARPS = NT // 32  # warps a CTA (cute/base.py's NW)
# past this batch the router's rows (qwen3-30b-a3b: 128 of them, 8 tiles) run once per chunk of about this many
# tokens, each chunk's tiles its own instructions: 8 instructions left the other CTAs idle (the router's phase 27 us
# a layer for 0.5 MB at batch 17, 8 instructions of 21 us, on an H100; docs/megakernel.md)
ROUTER_TOKENS = 8


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


def qkv_rows(b: Builder, H: int, KH: int, d: int) -> list[int]:
    """Rows per tile of q, k and v, which share a phase: tiled jointly (Builder.phase_rows), so the phase makes at
    most one instruction a CTA. One rows-per-tile for the three made 134 instructions on 132 CTAs at qwen3-30b-a3b
    batch 1 (4096 + 512 + 512 rows by 39: k's and v's last tiles of 5 rows), two CTAs running two."""
    return b.phase_rows([(H * d, 1), (KH * d, 1), (KH * d, 1)])


def gqa_layer(b: Builder, i: int, p: str, att_bits: int, io: LayerIO) -> None:
    cfg, B = b.cfg, b.B
    H, KH, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    a = f"{p}.self_attn"
    b.buf("qkv", B * (H + 2 * KH) * d)
    ws = ((f"{a}.q_proj.weight", 0), (f"{a}.k_proj.weight", H * d), (f"{a}.v_proj.weight", (H + KH) * d))
    for (w, col), rows in zip(ws, qkv_rows(b, H, KH, d)):
        b.matvec(i, w.split(".")[-2], w, io.x, "qkv", col, norm=f"{p}.input_layernorm.weight", rows=rows)
    b.close(f"L{i}.qkv")
    S = b.splits(B * KH)
    b.buf("part", B * H * S * (d + 2))
    kc, vc = b.t(f"cache.{i}.0", "produced"), b.t(f"cache.{i}.1", "produced")

    def attn(s_: int, h: int, s: int, flags: int, name: str) -> None:
        b.add("ATTN_GQA", i, name, flags, bytes_=0, kc=kc, vc=vc,
              qkv_off=b.f32["qkv"][0], qkv_stride=(H + 2 * KH) * d, qn_w=b.t(f"{a}.q_norm.weight"),
              kn_w=b.t(f"{a}.k_norm.weight"), pos_off=b.i32["positions"][0], slot_off=b.i32["slots"][0],
              b=s_, h=h, s=s, S=S, H=H, KH=KH, d=d, part_off=b.f32["part"][0],
              scale_bits=f32_bits(d ** -0.5), eps_bits=b.eps, rope_w=b._tidx["rope.inv_freq"],
              att_bits=att_bits, Lmax=b.cache.max_len)

    if b.causal_rows:  # every row's key and value written a phase before any row's attention reads the cache
        for s_ in range(B):
            for h in range(KH):
                attn(s_, h, S - 1, F_KV_WRITE, f"L{i}.kv[{s_},{h}]")
        b.close(f"L{i}.kv")
    for s_ in range(B):
        for h in range(KH):
            for s in range(S):
                attn(s_, h, s, F_KV_READ if b.causal_rows else 0, f"L{i}.attn[{s_},{h},{s}]")
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


def mla_layer(b: Builder, i: int, p: str, att_bits: int, io: LayerIO) -> None:
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


def kda_layer(b: Builder, i: int, p: str, io: LayerIO) -> None:
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


def dense_layer(b: Builder, i: int, p: str, io: LayerIO) -> None:
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


def route_in_up(cfg, B: int, shared: bool, quant: bool) -> bool:
    """Whether the layer's EXPERT_UP items route the token themselves (F_ROUTE, isa.ROUTE_IN_UP_MAX_B) instead of
    a ROUTE phase: softmax scores without groups, bf16 experts without shared ones, within the in-item picks' limits
    (ops/expert_up.check_route)."""
    return (B <= ROUTE_IN_UP_MAX_B and not shared and not quant and cfg.score_func == "softmax"
            and cfg.n_group == 1 and cfg.num_experts <= NT and cfg.top_k <= 32)


def _route(b: Builder, i: int, m: str, shared: bool, in_up: bool = False) -> None:
    """The router's logits (post-attention norm fused; the tile at row 0 writes the normed rows) are made by the
    caller's phase; this phase picks the experts (ROUTE) and runs the shared experts' down projection. `in_up`
    (route_in_up): only ROUTE's buffers; EXPERT_UP picks the experts."""
    cfg, B = b.cfg, b.B
    E, A = cfg.num_experts, cfg.top_k
    for name, n in (("ids", B * A), ("nuniq", 1), ("uniq", E), ("pstart", E + 1), ("ptok", B * A),
                    ("pslot", B * A), ("pairof", B * A), ("qst", min(E, B * A) + 1)):
        b.buf(name, n, ints=True)
    b.buf("wts", B * A)
    if in_up:
        return
    sigmoid = cfg.score_func == "sigmoid"
    bias = f"{m}.gate.e_score_correction_bias"
    flags = (F_SIGMOID if sigmoid else 0) | (F_RENORM if cfg.norm_topk_prob else 0)
    route = dict(logits_off=b.f32["router_logits"][0], E=E, A=A, B=B,
                 bias_w=b.t(bias) if sigmoid and bias in b.weights else -1, n_group=cfg.n_group,
                 topk_group=cfg.topk_group, scale_bits=f32_bits(cfg.routed_scaling_factor if sigmoid else 1.0),
                 ids_off=b.i32["ids"][0], wts_off=b.f32["wts"][0], nuniq_off=b.i32["nuniq"][0],
                 uniq_off=b.i32["uniq"][0], pstart_off=b.i32["pstart"][0], ptok_off=b.i32["ptok"][0],
                 pslot_off=b.i32["pslot"][0], pairof_off=b.i32["pairof"][0], qst_off=b.i32["qst"][0])
    split = B > ROUTE_SPLIT_B
    if split:  # the picks of ROUTE_TOKENS tokens an instruction, on as many CTAs (F_PICKS); the tables after them
        for t0 in range(0, B, ROUTE_TOKENS):
            t1 = min(B, t0 + ROUTE_TOKENS)
            b.add("ROUTE", i, f"L{i}.route", flags | F_PICKS, bytes_=(t1 - t0) * E * 4, t0=t0, t1=t1, **route)
    else:
        b.add("ROUTE", i, f"L{i}.route", flags, bytes_=B * E * 4, t0=0, t1=B, **route)
    if shared:
        b.buf("shared_out", B * cfg.hidden_size)
        b.matvec(i, "shared_down", f"{m}.shared_experts.down_proj.weight", "shared_h", "shared_out")
    b.close(f"L{i}.route")
    if split:
        b.add("ROUTE", i, f"L{i}.route_tables", flags | F_TABLES, bytes_=B * A * 4, t0=0, t1=0, **route)
        b.close(f"L{i}.route_tables")


def _experts(b: Builder, i: int, m: str, D: int, x: str, out: str, flags_up: int, flags_down: int,
             shared_off: int, quant: bool, in_up: bool = False) -> None:
    """EXPERT_UP (work-balanced items of (selected expert, row tile)) and EXPERT_DOWN (row tiles over every
    selected expert, the weighted combine fused) of the routed experts, D their input / output width. Experts in
    fragment order: EXPERT_DOWN's items are pair-major like EXPERT_UP's, and COMBINE is the phase after them."""
    cfg, B = b.cfg, b.B
    E, A, I = cfg.num_experts, cfg.top_k, cfg.moe_intermediate_size
    b.buf("h", B * A * I)
    b.buf("y", B * A * D)
    sel = expected_experts(E, A, B)
    gu_name = f"{m}.experts.gate_up_proj" + (".weight_packed" if quant else "")
    # MXFP4 experts held in fragment order (the executor's choice, backends/expert_layout.py): the tensor-core
    # bodies, whose shares are whole units (EXPERT_UP: a gate tile and its up tile; EXPERT_DOWN: FRAG_DOWN rows)
    frag = quant and is_frag_entry(b.weights[gu_name])
    # work items: equal shares of the rows of every selected expert's passes over its pairs (isa.up_chunks),
    # about one per CTA: as many as the expected selected rows allow, at least a few rows each
    W = max(1, min(b.ctas, math.ceil(sel) * I // 8))
    if frag:  # units (pair, 16-row tile), B * A pairs: the fewest items of a whole number of units a warp each
        units = B * A * (I // FRAG_TILE)
        per_warp = math.ceil(units / (WARPS * b.ctas))
        W = math.ceil(units / (WARPS * per_warp))
    dn_name = f"{m}.experts.down_proj" + (".weight_packed" if quant else "")
    wbytes = 0.53125 if quant else b.wbytes  # MXFP4: 4.25 bits per weight
    gu, gus = b.t(gu_name), b.t(f"{m}.experts.gate_up_proj.weight_scale") if quant else -1
    # bf16 experts grouped on the tensor cores (F_GROUP) from GROUP_MIN_B tokens, where the dims allow (ops/expert_up
    # check_group): units (pass of GROUP_N pairs, 16-row tile), the expected passes sel or more
    group = (not quant and not in_up and B >= GROUP_MIN_B and E <= GROUP_MAX_E
             and b.weights[gu_name].dtype == torch.bfloat16  # what the kernel runs (fp32: pyvm's exact programs)
             and all(n % GROUP_TILE == 0 and n % TC_K == 0 for n in (I, D)))
    if group:
        units = math.ceil(max(sel, B * A / GROUP_N)) * (I // GROUP_TILE)
        per_warp = math.ceil(units / (WARPS * b.ctas))
        W = math.ceil(units / (WARPS * per_warp))
    if not quant and not group and B <= PAIR1_MAX_B:  # isa.up_passes: bf16 experts one pair a pass at small batches
        flags_up |= F_PAIR1
    if frag:
        flags_up |= F_FRAG
        flags_down |= F_FRAG
    if group:
        flags_up |= F_GROUP
        flags_down |= F_GROUP
    # the routing (F_ROUTE: each item's own, from the router's logits; else ROUTE's phase before)
    routing = dict(logits_off=-1, E=E, A=A, scale_bits=f32_bits(1.0), ids_off=-1, wts_off=-1, pslot_off=-1,
                   pairof_off=-1)
    if in_up:
        flags_up |= F_ROUTE | (F_RENORM if cfg.norm_topk_prob else 0)
        routing.update(logits_off=b.f32["router_logits"][0], ids_off=b.i32["ids"][0], wts_off=b.f32["wts"][0],
                       pslot_off=b.i32["pslot"][0], pairof_off=b.i32["pairof"][0])
    for w in range(W):
        b.add("EXPERT_UP", i, f"L{i}.up[{w}]", flags_up, bytes_=int(2 * I * D * wbytes * sel / W), gu=gu, I=I,
              D=D, x_off=b.f32[x][0], h_off=b.f32["h"][0], w=w, W=W, nuniq_off=b.i32["nuniq"][0],
              uniq_off=b.i32["uniq"][0], pstart_off=b.i32["pstart"][0], ptok_off=b.i32["ptok"][0], gus=gus,
              qst_off=b.i32["qst"][0], **routing)
    b.close(f"L{i}.up")
    dn, dns = b.t(dn_name), b.t(f"{m}.experts.down_proj.weight_scale") if quant else -1
    common = dict(dn=dn, I=I, D=D, h_off=b.f32["h"][0], y_off=b.f32["y"][0], out_off=b.f32[out][0], B=B, A=A,
                  nuniq_off=b.i32["nuniq"][0], uniq_off=b.i32["uniq"][0], pstart_off=b.i32["pstart"][0],
                  wts_off=b.f32["wts"][0], pairof_off=b.i32["pairof"][0], shared_off=shared_off, dns=dns)
    rows = b.rows_per_tile(D)
    if frag or group:
        # pair-major items of (pair, FRAG_DOWN rows) units, sized as EXPERT_UP's; each CTA stages its pairs' h rows
        # (cute/moe.py expert_down_frag), and the weighted sum is a phase of its own (COMBINE) after them. F_GROUP:
        # units (pass, 16 rows), each a warp's tile against GROUP_N pairs (cute/moe.py expert_down_group)
        units = B * A * (D // FRAG_DOWN)
        if group:
            units = math.ceil(max(sel, B * A / GROUP_N)) * (D // GROUP_TILE)
        per_warp = math.ceil(units / (WARPS * b.ctas))
        Wd = math.ceil(units / (WARPS * per_warp))
        for w in range(Wd):
            b.add("EXPERT_DOWN", i, f"L{i}.down[{w}]", flags_down & ~(F_STORE | F_SHARED),
                  bytes_=int(sel * D * I * wbytes / Wd), r0=0, r1=D, w=w, W=Wd, **common)
        b.close(f"L{i}.down")
        for r0 in range(0, D, rows):
            r1 = min(D, r0 + rows)
            b.add("COMBINE", i, f"L{i}.combine[{r0}:{r1}]", flags_down & (F_STORE | F_SHARED),
                  **{k: common[k] for k in ("y_off", "out_off", "D", "B", "A", "wts_off", "pairof_off",
                                            "shared_off")}, r0=r0, r1=r1)
        b.close(f"L{i}.combine")
        return
    for r0 in range(0, D, rows):
        r1 = min(D, r0 + rows)
        b.add("EXPERT_DOWN", i, f"L{i}.down[{r0}:{r1}]", flags_down, bytes_=int(sel * (r1 - r0) * I * wbytes),
              r0=r0, r1=r1, w=0, W=1, **common)
    b.close(f"L{i}.down")


def moe_layer(b: Builder, i: int, p: str, io: LayerIO) -> None:
    cfg, B, D = b.cfg, b.B, b.cfg.hidden_size
    m = f"{p}.mlp"
    post = f"{p}.post_attention_layernorm.weight"
    b.buf("router_logits", B * cfg.num_experts)
    b.buf("normed", B * D)
    shared = cfg.n_shared_experts > 0
    rr = max(1, b.rows_per_tile(cfg.num_experts, per=0.5))
    if shared:  # the router and the shared experts' GLU share the phase: tiles of about equal bytes
        rr, rs = b.phase_rows([(cfg.num_experts, D * b.wbytes),
                               (cfg.shared_intermediate_size, 2 * D * b.wbytes)])
    # the router's rows in token chunks past ROUTER_TOKENS (the shared experts' GLU, beside it, takes the batch)
    chunk = ROUTER_TOKENS if not shared and B > ROUTER_TOKENS else 0
    b.matvec(i, "router", f"{m}.gate.weight", io.x, "router_logits", norm=post, write_normed="normed", rows=rr,
             x2=io.mlp_x2, chunk_tokens=chunk)
    if shared:
        b.buf("shared_h", B * cfg.shared_intermediate_size)
        b.glu(i, "shared_up", f"{m}.shared_experts.gate_proj.weight", f"{m}.shared_experts.up_proj.weight",
              io.x, "shared_h", norm=post, x2=io.mlp_x2, rows=rs)
    b.close(f"L{i}.router")
    in_up = route_in_up(cfg, B, shared, quant=False)
    _route(b, i, m, shared, in_up)
    _experts(b, i, m, D, "normed", io.out, 0, F_SHARED if shared else 0,
             b.f32["shared_out"][0] if shared else -1, quant=False, in_up=in_up)


def latent_moe_layer(b: Builder, i: int, p: str, io: LayerIO) -> None:
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
    # the router, the shared experts' GLU and latent_down share the phase: tiles of about equal bytes
    rr, rs, rl = b.phase_rows([(cfg.num_experts, D * b.wbytes), (cfg.shared_intermediate_size, 2 * D * b.wbytes),
                               (R, D * b.wbytes)])
    b.matvec(i, "router", f"{m}.gate.weight", io.x, "router_logits", norm=post, write_normed="normed", rows=rr,
             x2=io.mlp_x2)
    b.buf("shared_h", B * cfg.shared_intermediate_size)
    b.glu(i, "shared_up", f"{m}.shared_experts.gate_proj.weight", f"{m}.shared_experts.up_proj.weight", io.x,
          "shared_h", norm=post, x2=io.mlp_x2, rows=rs)
    b.matvec(i, "latent_down", f"{m}.latent_down.weight", io.x, "hlat", norm=post, x2=io.mlp_x2, rows=rl)
    b.close(f"L{i}.router")
    _route(b, i, m, shared=True)
    act = F_SITU if cfg.expert_act == "situ" else 0
    _experts(b, i, m, R, "hlat", "z", F_MXFP4 | act, F_MXFP4 | F_STORE, -1, quant=True)
    b.matvec(i, "latent_up", f"{m}.latent_up.weight", "z", io.out, norm=f"{m}.latent_norm.weight",
             resid=io.out_resid, add0="shared_out", add1=io.out_adds[0] if io.out_adds else None)
    b.close(f"L{i}.latent_up")
