"""qwen3_moe's config.json, read through transformers' Qwen3MoeConfig (its aliases, e.g. `num_local_experts`,
and its defaults where a field is left out; config/hf_class.py), then our checks."""

from __future__ import annotations

from ..fields import (
    common_fields,
    hf_eos,
    hf_field,
    hf_layer_list,
    hf_num_layers,
    hf_quantization,
    hf_rope,
    require_silu,
)
from ..hf_class import resolve
from ..model import ConfigError, ModelConfig

# The fields that set the model's size: no default, whatever Qwen3MoeConfig would fill in.
REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_experts",
            "num_experts_per_tok", "moe_intermediate_size", "max_position_embeddings")


def parse(d: dict) -> ModelConfig:
    quant, block = hf_quantization(d, d.get("model_type"))
    L = hf_num_layers(d)
    mlp_only = hf_layer_list(d, "mlp_only_layers", L)  # structure checked on what was written
    hf_rope(d, 0)
    hf_eos(d)
    r = resolve(d, "Qwen3MoeConfig", REQUIRED)
    require_silu(r)
    c = common_fields(r, L, raw=d)
    if r.get("use_sliding_window"):
        raise ConfigError("use_sliding_window=true is not supported for qwen3_moe")
    if r.get("attention_bias"):
        raise ConfigError("attention_bias=true is not supported for qwen3_moe")
    heads = c["num_heads"]
    head_dim = hf_field(r, "head_dim", c["hidden_size"] // heads if heads > 0 else 0, type_=int)
    step = hf_field(r, "decoder_sparse_step", 1, type_=int)
    if step < 1:
        raise ConfigError(f"decoder_sparse_step must be >= 1, got {step}")
    moe = tuple(i not in mlp_only and (i + 1) % step == 0 for i in range(L))
    if not all(moe) and d.get("intermediate_size") is None:
        # the width of the dense layers sets the model's size too: no default for it
        raise ConfigError("config.json is missing the field 'intermediate_size', which the dense layers "
                          "(mlp_only_layers / decoder_sparse_step) need")
    return ModelConfig(
        family="qwen3_moe", **c, rope=hf_rope(r, head_dim),
        num_experts=hf_field(r, "num_experts", type_=int), top_k=hf_field(r, "num_experts_per_tok", type_=int),
        moe_intermediate_size=hf_field(r, "moe_intermediate_size", type_=int),
        intermediate_size=hf_field(r, "intermediate_size", 0, type_=int),
        norm_topk_prob=bool(r.get("norm_topk_prob", False)), moe_layers=moe, score_func="softmax",
        num_kv_heads=hf_field(r, "num_key_value_heads", 4, type_=int), head_dim=head_dim,
        expert_quant=quant, weight_block=block,
    )
