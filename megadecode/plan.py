"""The decode plan: one model step as an ordered list of typed ops over named buffers.

Buffers are of three kinds: static weights (named as in `weights.param_specs`), activations (the
names in ACTIVATIONS, reused by every layer) and caches (`cache.{layer}`). Executors (`torch`,
`graph`, and the fused ones) run the same plan; the validation harness compares them op by op.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import ModelConfig
from .weights import param_specs

# Op kinds. Each names what it computes; the reference implementation lives in backends/torch/ops.py.
# ATTN_KDA (kimi_linear's linear-attention layers) reads/writes per-sequence state (conv window, recurrent
# state) instead of per-token KV; its cache is still `cache.{layer}`.
# kimi_k3 (megadecode/k3.md): ATTN_MLA with the output gate when the config has one (the gate weight is among
# the op's weights); ATTN_RES (Block Attention Residuals: the layer input as a softmax over block sums; at a
# block's first layer it also closes the previous block: `blocks` grows by `hidden`, `hidden` restarts at 0);
# LATENT_MOE (the routed half of Stable LatentMoE after the router: latent down, MXFP4 experts, norm, up).
# ADD_RMSNORM is a composite made by `fuse_add_rmsnorm` (never by build_plan): an ADD whose sum feeds the
# next op, an RMSNORM; it writes both the sum and the normed sum, and its reference is the two ops in turn.
EMBED, RMSNORM, ADD, ATTN_GQA, ATTN_MLA, ATTN_KDA, ROUTER, EXPERTS, MLP, LM_HEAD, ATTN_RES, LATENT_MOE = (
    "embed", "rmsnorm", "add", "attn_gqa", "attn_mla", "attn_kda", "router", "experts", "mlp", "lm_head",
    "attn_res", "latent_moe")
ADD_RMSNORM = "add_rmsnorm"
OP_KINDS = (EMBED, RMSNORM, ADD, ATTN_GQA, ATTN_MLA, ATTN_KDA, ROUTER, EXPERTS, MLP, LM_HEAD, ATTN_RES,
            LATENT_MOE, ADD_RMSNORM)

# Step inputs (written by the host before a step) and activations (written during the step).
INPUTS = ("tokens", "positions", "slots", "logit_rows")
# With AttnRes (kimi_k3), `hidden` is the current block's partial sum, `blocks` [n, N, D] the completed
# blocks' sums, `layer_in` a layer's (or the final norm's) AttnRes input, `post_attn` = layer_in + attn_out.
ACTIVATIONS = ("hidden", "normed", "attn_out", "topk_ids", "topk_weights", "moe_out", "shared_out",
               "mlp_out", "final", "logits", "blocks", "layer_in", "post_attn")


@dataclass(frozen=True)
class Op:
    kind: str
    layer: int  # -1 for model-level ops
    inputs: tuple[str, ...]  # activation / step-input buffers read
    outputs: tuple[str, ...]  # activation buffers written
    weights: tuple[str, ...] = ()  # static weights read
    cache: str | None = None  # cache buffer read and written

    @property
    def name(self) -> str:
        where = f"L{self.layer}." if self.layer >= 0 else ""
        return f"{where}{self.kind}:{'+'.join(self.outputs)}"

    def reads(self) -> tuple[str, ...]:
        return self.inputs + self.weights + ((self.cache,) if self.cache else ())

    def writes(self) -> tuple[str, ...]:
        return self.outputs + ((self.cache,) if self.cache else ())


@dataclass(frozen=True)
class DecodePlan:
    config: ModelConfig
    ops: tuple[Op, ...]

    def weight_names(self) -> set[str]:
        return {w for op in self.ops for w in op.weights}

    def written_buffers(self) -> set[str]:
        """Everything produced during a step: what no kernel may read through a non-coherent path."""
        return {b for op in self.ops for b in op.writes()}


def build_plan(cfg: ModelConfig) -> DecodePlan:
    specs = param_specs(cfg)

    def under(prefix: str) -> tuple[str, ...]:
        return tuple(n for n in specs if n.startswith(prefix + "."))

    B = cfg.attn_res_block_size

    def attn_res(i: int, prefix: str) -> Op:
        """Layer i's AttnRes (i = num_layers: the final norm's). Layer B first writes `blocks`."""
        start = 0 < i < cfg.num_layers and i % B == 0
        ins = ("hidden",) + (("blocks",) if i > B else ())
        outs = (("blocks", "hidden") if start else ()) + ("layer_in",)
        return Op(ATTN_RES, i if i < cfg.num_layers else -1, ins, outs, (f"{prefix}.query", f"{prefix}.norm.weight"))

    ops = [Op(EMBED, -1, ("tokens",), ("hidden",), ("model.embed_tokens.weight",))]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        x = "layer_in" if B else "hidden"  # the layer's input
        if B:
            ops.append(attn_res(i, f"{p}.attn_res"))
        if cfg.is_kda(i):  # no positions: KDA's state carries the order
            attn = Op(ATTN_KDA, i, ("normed", "slots"), ("attn_out",), under(f"{p}.self_attn"), f"cache.{i}")
        else:
            attn = Op(ATTN_MLA if cfg.is_mla else ATTN_GQA, i, ("normed", "positions", "slots"), ("attn_out",),
                      under(f"{p}.self_attn"), f"cache.{i}")
        mid = "post_attn" if B else "hidden"
        ops += [
            Op(RMSNORM, i, (x,), ("normed",), (f"{p}.input_layernorm.weight",)),
            attn,
            Op(ADD, i, (x, "attn_out"), (mid,)),
            Op(RMSNORM, i, (mid,), ("normed",), (f"{p}.post_attention_layernorm.weight",)),
        ]
        out = "moe_out" if cfg.moe_layers[i] else "mlp_out"
        if cfg.moe_layers[i] and cfg.latent_size:
            m = f"{p}.mlp"
            ops += [Op(ROUTER, i, ("normed",), ("topk_ids", "topk_weights"),
                       (f"{m}.gate.weight", f"{m}.gate.e_score_correction_bias")),
                    Op(LATENT_MOE, i, ("normed", "topk_ids", "topk_weights"), ("moe_out",),
                       tuple(n for n in under(m) if not n.startswith((f"{m}.gate.", f"{m}.shared_experts.")))),
                    Op(MLP, i, ("normed",), ("shared_out",), under(f"{m}.shared_experts")),
                    Op(ADD, i, ("moe_out", "shared_out"), ("moe_out",))]
        elif cfg.moe_layers[i]:
            gate = (f"{p}.mlp.gate.weight",) + ((f"{p}.mlp.gate.e_score_correction_bias",)
                                                if cfg.score_func == "sigmoid" else ())
            e = f"{p}.mlp.experts"
            # FP8 experts (cfg.expert_quant "fp8"): each stack's values, then its block scales
            experts = (f"{e}.gate_up_proj", f"{e}.down_proj")
            if cfg.expert_quant == "fp8":
                experts = (experts[0], f"{e}.gate_up_proj_scale_inv", experts[1], f"{e}.down_proj_scale_inv")
            ops += [Op(ROUTER, i, ("normed",), ("topk_ids", "topk_weights"), gate),
                    Op(EXPERTS, i, ("normed", "topk_ids", "topk_weights"), ("moe_out",), experts)]
            if cfg.n_shared_experts:
                ops += [Op(MLP, i, ("normed",), ("shared_out",), under(f"{p}.mlp.shared_experts")),
                        Op(ADD, i, ("moe_out", "shared_out"), ("moe_out",))]
        else:
            ops.append(Op(MLP, i, ("normed",), ("mlp_out",), under(f"{p}.mlp")))
        if B:  # the layer's output (attention + MLP) joins the block's partial sum
            ops.append(Op(ADD, i, ("attn_out", out), (out,)))
        ops.append(Op(ADD, i, ("hidden", out), ("hidden",)))
    if B:
        ops.append(attn_res(cfg.num_layers, "model.attn_res"))
    lm = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    ops += [Op(RMSNORM, -1, ("layer_in" if B else "hidden", "logit_rows"), ("final",), ("model.norm.weight",)),
            Op(LM_HEAD, -1, ("final",), ("logits",), (lm,))]
    return DecodePlan(cfg, tuple(ops))


def final_norm_input(plan: DecodePlan) -> str:
    """The buffer the final norm reads: the last layer's output of every token of a step (`hidden`; with AttnRes,
    `layer_in`), which holds it after the step."""
    op = next(op for op in reversed(plan.ops) if op.kind == RMSNORM and op.layer == -1)
    return op.inputs[0]


def fuse_add_rmsnorm(plan: DecodePlan) -> DecodePlan:
    """The same plan with every ADD immediately followed by a one-input RMSNORM of its sum replaced by one
    ADD_RMSNORM op (inputs: the two addends; outputs: the sum, then the normed sum; weights: the norm's).
    The residual add and the next norm then read the row once (the `fused` executor's rewrite)."""
    ops, i = [], 0
    while i < len(plan.ops):
        a = plan.ops[i]
        b = plan.ops[i + 1] if i + 1 < len(plan.ops) else None
        if (a.kind == ADD and b is not None and b.kind == RMSNORM and len(b.inputs) == 1
                and b.inputs[0] == a.outputs[0]):
            ops.append(Op(ADD_RMSNORM, b.layer, a.inputs, (a.outputs[0], b.outputs[0]), b.weights))
            i += 2
        else:
            ops.append(a)
            i += 1
    return DecodePlan(plan.config, tuple(ops))
