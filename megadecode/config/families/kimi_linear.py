"""kimi_linear's config.json, read through transformers' KimiLinearConfig (its aliases, e.g. `num_experts` /
`num_local_experts`, `num_expert_group` / `n_group`, and its defaults; config/hf_class.py), then `build`, which
kimi_k3's parser shares (K3 has no transformers class: it fills in its own defaults and calls `build`)."""

from __future__ import annotations

from ..fields import (
    hf_alias,
    hf_eos,
    hf_field,
    hf_num_layers,
    hf_quantization,
    hf_special_tokens,
    require_silu,
)
from ..hf_class import resolve
from ..model import ConfigError, ModelConfig, RopeConfig

# The fields that set the model's size: no default, whatever KimiLinearConfig would fill in.
REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


# Fields of the hub's config.json (its own modeling code reads them; KimiLinearConfig ignores them): only the
# released model's values are supported, anything else would build another model than the hub's code does.
HUB_ONLY = {"moe_router_activation_func": "sigmoid", "moe_layer_freq": 1, "mla_use_nope": True}


def parse(d: dict) -> ModelConfig:
    quant, block = hf_quantization(d, d.get("model_type"))
    for key, want in HUB_ONLY.items():
        if d.get(key, want) != want:
            raise ConfigError(f"config field {key!r} = {d[key]!r} is not supported for kimi_linear (only {want!r}, "
                              f"as the released model and transformers' KimiLinear)")
    L = hf_num_layers(d)
    _linear_attn_layers(d, L)  # KimiLinearConfig would index a layer 0 as the last layer: checked first
    hf_eos(d)
    r = resolve(d, "KimiLinearConfig", REQUIRED)
    require_silu(r)
    return build(r, L, raw=d, expert_quant=quant, weight_block=block)


def _linear_attn_layers(d: dict, L: int) -> list[str] | None:
    """Layer kinds from `linear_attn_config`'s 1-indexed `full_attn_layers` / `kda_layers` (None when it has
    neither list), checked."""
    lin = d.get("linear_attn_config") or {}
    if not isinstance(lin, dict):
        raise ConfigError(f"config field 'linear_attn_config' must be a JSON object, got {lin!r}")
    if not ("full_attn_layers" in lin and "kda_layers" in lin):
        return None
    types = [None] * L
    for key, kind in (("full_attn_layers", "full_attention"), ("kda_layers", "linear_attention")):
        v = lin[key]
        if not isinstance(v, list) or not all(isinstance(j, int) and not isinstance(j, bool) and 1 <= j <= L
                                              for j in v):
            raise ConfigError(f"linear_attn_config {key!r} must list 1-indexed layers in [1, {L}], got {v!r}")
        for j in v:
            types[j - 1] = kind
    return types


def build(d: dict, L: int, raw: dict | None = None, **extra) -> ModelConfig:
    """kimi_linear from a dict holding every field under KimiLinearConfig's names (either spelling of an aliased
    one) or absent (KimiLinearConfig's default). Layer kinds: `layer_types`, else `linear_attn_config`'s
    1-indexed `full_attn_layers` / `kda_layers`, else every 4th layer (not layer 0) is MLA. MLP kinds:
    `mlp_layer_types`, else the first `first_k_dense_replace` (default 1) layers dense. The MLA layers use
    no rotary embedding at all, so rope fields are ignored. `raw`: the config.json as written (ModelConfig.hf);
    `extra`: more ModelConfig fields."""
    if d.get("attention_bias"):
        raise ConfigError("attention_bias=true is not supported for kimi_linear")
    lin = d.get("linear_attn_config") or {}
    if not isinstance(lin, dict):
        raise ConfigError(f"config field 'linear_attn_config' must be a JSON object, got {lin!r}")
    types = d.get("layer_types")
    if types is None:
        types = _linear_attn_layers(d, L)
    if types is None:
        types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(L)]
    if not isinstance(types, list) or len(types) != L or not set(types) <= {"full_attention", "linear_attention"}:
        raise ConfigError(f"layer_types must list 'full_attention' / 'linear_attention' for each of the {L} "
                          f"layers, got {types!r}")
    mlp_types = d.get("mlp_layer_types")
    if mlp_types is None:
        first_dense = hf_field(d, "first_k_dense_replace", 1, type_=int)
        mlp_types = ["dense" if i < first_dense else "sparse" for i in range(L)]
    if not isinstance(mlp_types, list) or len(mlp_types) != L or not set(mlp_types) <= {"dense", "sparse"}:
        raise ConfigError(f"mlp_layer_types must list 'dense' / 'sparse' for each of the {L} layers, "
                          f"got {mlp_types!r}")
    heads = hf_field(d, "num_attention_heads", type_=int)
    vocab = hf_field(d, "vocab_size", type_=int)
    bos, eos = hf_special_tokens(d, vocab) if isinstance(vocab, int) and vocab > 0 else (None, ())
    return ModelConfig(
        family="kimi_linear", vocab_size=vocab,
        hidden_size=hf_field(d, "hidden_size", type_=int), num_layers=L, num_heads=heads,
        rms_norm_eps=float(hf_field(d, "rms_norm_eps", 1e-5, type_=float)),
        max_position_embeddings=hf_alias(d, ("max_position_embeddings", "model_max_length"), 1048576, type_=int),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        bos_token_id=bos, eos_token_id=eos, hf=dict(d if raw is None else raw),
        rope=RopeConfig(theta=10000.0),  # unused: mla_rope=False
        num_experts=hf_alias(d, ("num_experts", "num_local_experts"), 256, type_=int),
        top_k=hf_alias(d, ("num_experts_per_tok", "num_experts_per_token"), 8, type_=int),
        moe_intermediate_size=hf_field(d, "moe_intermediate_size", 1024, type_=int),
        intermediate_size=hf_field(d, "intermediate_size", 9216, type_=int),
        norm_topk_prob=bool(hf_alias(d, ("norm_topk_prob", "moe_renormalize"), True)),
        moe_layers=tuple(t == "sparse" for t in mlp_types), score_func="sigmoid",
        n_group=hf_alias(d, ("n_group", "num_expert_group"), 1, type_=int),
        topk_group=hf_field(d, "topk_group", 1, type_=int),
        routed_scaling_factor=float(hf_field(d, "routed_scaling_factor", 2.446, type_=float)),
        n_shared_experts=hf_alias(d, ("n_shared_experts", "num_shared_experts"), 1, type_=int),
        q_lora_rank=hf_field(d, "q_lora_rank", None, type_=int), kv_lora_rank=hf_field(d, "kv_lora_rank", 512, type_=int),
        qk_nope_head_dim=hf_field(d, "qk_nope_head_dim", 128, type_=int),
        qk_rope_head_dim=hf_field(d, "qk_rope_head_dim", 64, type_=int),
        v_head_dim=hf_field(d, "v_head_dim", 128, type_=int), mla_rope=False,
        num_kv_heads=hf_field(d, "num_key_value_heads", heads, type_=int),
        kda_layers=tuple(t == "linear_attention" for t in types),
        linear_num_heads=hf_field(lin, "num_heads", hf_field(d, "linear_num_heads", 32, type_=int), type_=int),
        linear_head_dim=hf_field(lin, "head_dim", hf_field(d, "linear_head_dim", 128, type_=int), type_=int),
        conv_kernel=hf_field(lin, "short_conv_kernel_size", hf_field(d, "linear_conv_kernel_dim", 4, type_=int),
                         type_=int),
        **extra,
    )
