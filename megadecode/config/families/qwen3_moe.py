"""qwen3_moe's config.json (Qwen3MoeConfig's defaults where a field is left out)."""

from __future__ import annotations

from ..fields import (
    common_fields,
    hf_field,
    hf_layer_list,
    hf_num_layers,
    hf_rope,
    reject_quantized,
    require_silu,
)
from ..model import ConfigError, ModelConfig


def parse(d: dict) -> ModelConfig:
    reject_quantized(d, d.get("model_type"))
    require_silu(d)
    L = hf_num_layers(d)
    c = common_fields(d, L)
    if d.get("use_sliding_window"):
        raise ConfigError("use_sliding_window=true is not supported for qwen3_moe")
    if d.get("attention_bias"):
        raise ConfigError("attention_bias=true is not supported for qwen3_moe")
    heads = c["num_heads"]
    head_dim = hf_field(d, "head_dim", c["hidden_size"] // heads if heads > 0 else 0, type_=int)
    step = hf_field(d, "decoder_sparse_step", 1, type_=int)
    if step < 1:
        raise ConfigError(f"decoder_sparse_step must be >= 1, got {step}")
    mlp_only = hf_layer_list(d, "mlp_only_layers", L)
    E = hf_field(d, "num_experts", type_=int)
    moe = tuple(i not in mlp_only and (i + 1) % step == 0 for i in range(L))
    return ModelConfig(
        family="qwen3_moe", **c, rope=hf_rope(d, head_dim),
        num_experts=E, top_k=hf_field(d, "num_experts_per_tok", type_=int),
        moe_intermediate_size=hf_field(d, "moe_intermediate_size", type_=int),
        intermediate_size=hf_field(d, "intermediate_size", 0, type_=int),
        norm_topk_prob=bool(d.get("norm_topk_prob", False)), moe_layers=moe, score_func="softmax",
        num_kv_heads=hf_field(d, "num_key_value_heads", 4, type_=int), head_dim=head_dim,  # Qwen3MoeConfig
    )
