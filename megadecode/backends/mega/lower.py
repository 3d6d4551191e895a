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

from ...config.registry import families_for
from ...plan import build_plan
from ...reference.rope import inv_freq_and_scale
from .builder import Builder
from .isa import (
    F_GREEDY,
    f32_bits,
)
from .layers import (
    LayerIO,
    dense_layer,
    gqa_layer,
    kda_layer,
    latent_moe_layer,
    mla_layer,
    moe_layer,
)
from .program import Program

FAMILIES = families_for("mega")  # the families the instruction stream lowers (config/registry.py)
MAX_BATCH = 64
LM_PER = 4.0  # lm_head tiles a CTA (Builder.rows_per_tile's `per`): its 151936 rows (qwen3) in 1056 tiles on 264 CTAs


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
    if 2 * cfg.num_experts > 1900:
        return f"{cfg.num_experts} experts (ROUTE counts the pairs per expert in 1900 words of shared memory)"
    return None




def lower(cfg, weights: dict, cache, batch: int, num_ctas: int = 132, sample: str | None = None,
          causal_rows: bool = False) -> Program:
    """The instructions of one decode step of `batch` sequences. `sample`: None (logits only), "greedy" or
    "temperature" (a SAMPLE instruction per sequence after the lm_head). `causal_rows`: the rows may be
    consecutive positions of one sequence (a speculative verify step, Step.causal_rows), so every row's cache entry
    is written a phase before any row's attention reads the cache (GQA layers: an F_KV_WRITE phase; MLA layers
    write theirs in MLA_KV, two phases before MLA_ATTN, either way)."""
    why = supports(cfg, batch)
    if why:
        raise Unsupported(f"the mega executor does not support {why}")
    b = Builder(cfg, weights, cache, batch, num_ctas, sample, causal_rows)
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
            gqa_layer(b, i, p, att_bits, io)
        elif cfg.is_kda(i):
            kda_layer(b, i, p, io)
        else:
            mla_layer(b, i, p, att_bits, io)
        if not cfg.moe_layers[i]:
            dense_layer(b, i, p, io)
        elif cfg.latent_size:
            latent_moe_layer(b, i, p, io)
        else:
            moe_layer(b, i, p, io)
    final = "hidden"
    if Bsz:
        _attn_res(b, -1, "model.attn_res", nblocks)
        final = "layer_in"
    V = cfg.vocab_size
    b.buf("logits", B * V)
    lm = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    b.matvec(-1, "lm_head", lm, final, "logits", norm="model.norm.weight", rows=b.rows_per_tile(V, per=LM_PER))
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


def _attn_res(b: Builder, i: int, prefix: str, nsrc: int) -> None:
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


def check_plan(plan, cfg) -> None:
    """The mega executor lowers the plan `build_plan` makes for the config; a rewritten plan is refused."""
    if plan.ops != build_plan(cfg).ops:
        raise Unsupported("the mega executor lowers the plan build_plan(cfg) makes; this plan differs")
