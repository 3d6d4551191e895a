"""config.json -> ModelConfig: presets round-trip, layer layouts, rope parsing, and every rejection names
the field that is wrong."""

from __future__ import annotations

import json
import math

import pytest

from megadecode.config import ConfigError, ModelConfig, RopeConfig, config_from_hf, load_config, yarn_mscale
from megadecode.presets import PRESETS, preset_config, preset_hf_config


def hf(name: str, **changes) -> dict:
    """A preset's config.json with fields changed; a value of `...` deletes the field."""
    d = preset_hf_config(name)
    for k, v in changes.items():
        if v is ...:
            d.pop(k, None)
        else:
            d[k] = v
    return d


QWEN, DS = "tiny-qwen3-moe", "tiny-deepseek-v3"


# ---- presets ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_round_trips_through_config_json(name, tmp_path):
    d = preset_hf_config(name)
    cfg = config_from_hf(d)
    assert cfg == preset_config(name)
    (tmp_path / "config.json").write_text(json.dumps(d))
    assert load_config(tmp_path) == cfg  # a directory
    assert load_config(tmp_path / "config.json") == cfg  # the file itself
    # to_dict carries every field: rebuilding the dataclass from it gives the same config.
    assert ModelConfig(**cfg.to_dict()) == cfg
    # The fields every family shares are read as written.
    assert cfg.vocab_size == d["vocab_size"]
    assert cfg.hidden_size == d["hidden_size"]
    assert cfg.num_layers == d["num_hidden_layers"] == len(cfg.moe_layers)
    assert cfg.num_heads == d["num_attention_heads"]
    assert cfg.top_k == d["num_experts_per_tok"]
    assert cfg.moe_intermediate_size == d["moe_intermediate_size"]
    assert cfg.max_position_embeddings == d["max_position_embeddings"]
    assert cfg.eos_token_id == (d["eos_token_id"],)
    assert cfg.bos_token_id == d["bos_token_id"]
    assert cfg.hf == d


def test_preset_qwen3_moe_values():
    cfg = preset_config(QWEN)
    assert cfg.family == "qwen3_moe" and not cfg.is_mla
    assert (cfg.num_experts, cfg.top_k, cfg.num_kv_heads, cfg.head_dim) == (8, 2, 2, 16)
    assert cfg.score_func == "softmax" and cfg.norm_topk_prob
    assert (cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor, cfg.n_shared_experts) == (1, 1, 1.0, 0)
    assert cfg.moe_layers == (True, False, True)  # mlp_only_layers [1]
    assert cfg.rope == RopeConfig(theta=10000.0)
    assert cfg.cache_width == 2 * 2 * 16
    assert cfg.softmax_scale == pytest.approx(16 ** -0.5)


def test_preset_deepseek_v3_values():
    cfg = preset_config(DS)
    assert cfg.family == "deepseek_v3" and cfg.is_mla
    assert (cfg.num_experts, cfg.top_k) == (16, 4)
    # Group routing and scaling are exercised with non-default values.
    assert (cfg.n_group, cfg.topk_group) == (4, 2)
    assert cfg.routed_scaling_factor == 2.5 and cfg.n_shared_experts == 1
    assert cfg.score_func == "sigmoid" and cfg.norm_topk_prob
    assert cfg.moe_layers == (False, True, True)  # first_k_dense_replace 1
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == \
        (32, 32, 16, 8, 16)
    assert cfg.qk_head_dim == 24 and cfg.rope_dim == 8 and cfg.cache_width == 40
    assert cfg.shared_intermediate_size == 32
    assert cfg.rope.kind == "yarn" and cfg.rope.factor == 4.0
    assert cfg.rope.original_max_position_embeddings == 128
    m = 0.1 * math.log(4.0) + 1.0
    assert yarn_mscale(4.0, 1.0) == pytest.approx(m)
    assert cfg.softmax_scale == pytest.approx(24 ** -0.5 * m * m)


def test_preset_qwen3_30b_shape():
    cfg = preset_config("qwen3-30b-a3b")
    assert cfg.num_layers == 48 and all(cfg.moe_layers)
    assert (cfg.num_experts, cfg.top_k, cfg.num_kv_heads, cfg.head_dim) == (128, 8, 4, 128)
    assert cfg.cache_width == 1024


def test_kimi_k2_is_deepseek_v3():
    ds = config_from_hf(hf(DS))
    kimi = config_from_hf(hf(DS, model_type="kimi_k2"))
    assert kimi.family == "deepseek_v3" and kimi.is_mla
    assert kimi == ds  # same architecture, field for field
    assert kimi.hf["model_type"] == "kimi_k2"


# ---- which layers are MoE ---------------------------------------------------------------------------

@pytest.mark.parametrize("step, mlp_only, want", [
    (1, [], (True,) * 6),
    (1, [0, 3], (False, True, True, False, True, True)),
    (2, [], (False, True, False, True, False, True)),  # (i + 1) % step == 0, as in transformers
    (2, [3], (False, True, False, False, False, True)),
    (3, None, (False, False, True, False, False, True)),
])
def test_qwen_moe_layers(step, mlp_only, want):
    cfg = config_from_hf(hf(QWEN, num_hidden_layers=6, decoder_sparse_step=step, mlp_only_layers=mlp_only))
    assert cfg.moe_layers == want


def test_qwen_moe_layers_defaults():
    cfg = config_from_hf(hf(QWEN, decoder_sparse_step=..., mlp_only_layers=...))
    assert cfg.moe_layers == (True, True, True)


@pytest.mark.parametrize("first_dense, want", [
    (0, (True, True, True)), (1, (False, True, True)), (2, (False, False, True)),
    (..., (False, False, False)),  # DeepseekV3Config's default of 3 dense layers
])
def test_deepseek_moe_layers(first_dense, want):
    cfg = config_from_hf(hf(DS, first_k_dense_replace=first_dense))
    assert cfg.moe_layers == want


# ---- defaults follow transformers' config classes ------------------------------------------------

OPTIONAL = {
    QWEN: ["num_key_value_heads", "decoder_sparse_step", "mlp_only_layers", "norm_topk_prob", "rms_norm_eps",
           "rope_theta", "tie_word_embeddings", "head_dim", "hidden_act"],
    DS: ["n_group", "topk_group", "routed_scaling_factor", "n_shared_experts", "first_k_dense_replace",
         "q_lora_rank", "norm_topk_prob", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_interleave",
         "tie_word_embeddings", "scoring_func", "topk_method", "hidden_act"],
}


@pytest.mark.parametrize("name", [QWEN, DS])
def test_missing_optional_fields_take_transformers_defaults(name):
    """A config.json without the optional fields must build the model transformers would build."""
    import transformers

    d = hf(name, **{k: ... for k in OPTIONAL[name]})
    if name == QWEN:
        d["num_attention_heads"] = 8  # the default 4 kv heads must divide the heads
    else:
        d.update(n_routed_experts=32, num_experts_per_tok=4, num_hidden_layers=5)  # room for 8 groups, 3 dense
    ref = (transformers.Qwen3MoeConfig if name == QWEN else transformers.DeepseekV3Config)(**d)
    cfg = config_from_hf(d)
    assert cfg.rms_norm_eps == ref.rms_norm_eps
    assert cfg.norm_topk_prob == ref.norm_topk_prob
    assert cfg.tie_word_embeddings == ref.tie_word_embeddings
    assert cfg.rope.theta == ref.rope_parameters["rope_theta"] and cfg.rope.kind == "default"
    if name == QWEN:
        assert cfg.num_kv_heads == ref.num_key_value_heads
        assert cfg.head_dim == (getattr(ref, "head_dim", None) or ref.hidden_size // ref.num_attention_heads)
        assert cfg.moe_layers == (True,) * ref.num_hidden_layers
    else:
        assert (cfg.n_group, cfg.topk_group) == (ref.n_group, ref.topk_group)
        assert cfg.routed_scaling_factor == ref.routed_scaling_factor
        assert cfg.n_shared_experts == ref.n_shared_experts
        assert cfg.q_lora_rank == ref.q_lora_rank
        assert cfg.moe_layers == tuple(i >= ref.first_k_dense_replace for i in range(5))
        assert cfg.rope_interleave == ref.rope_interleave


def test_null_q_lora_rank_means_no_low_rank_query():
    assert config_from_hf(hf(DS, q_lora_rank=None)).q_lora_rank is None
    assert config_from_hf(hf(DS, q_lora_rank=...)).q_lora_rank == 1536


# ---- rope -------------------------------------------------------------------------------------------

YARN = {"factor": 8.0, "original_max_position_embeddings": 64, "beta_fast": 16, "beta_slow": 2,
        "mscale": 0.5, "mscale_all_dim": 0.75}
WANT_YARN = RopeConfig(theta=50000.0, kind="yarn", factor=8.0, original_max_position_embeddings=64,
                       beta_fast=16.0, beta_slow=2.0, mscale=0.5, mscale_all_dim=0.75)


@pytest.mark.parametrize("name", [QWEN, DS])
def test_yarn_from_rope_scaling_old_style(name):
    cfg = config_from_hf(hf(name, rope_theta=50000.0, rope_scaling={"type": "yarn", **YARN}))
    assert cfg.rope == WANT_YARN


@pytest.mark.parametrize("name", [QWEN, DS])
def test_yarn_from_rope_scaling_with_rope_type_key(name):
    cfg = config_from_hf(hf(name, rope_theta=50000.0, rope_scaling={"rope_type": "yarn", **YARN}))
    assert cfg.rope == WANT_YARN


@pytest.mark.parametrize("name", [QWEN, DS])
def test_yarn_from_rope_parameters_transformers5_style(name):
    d = hf(name, rope_theta=..., rope_scaling=...,
           rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, **YARN})
    assert config_from_hf(d).rope == WANT_YARN


def test_rope_parameters_default_reads_theta():
    d = hf(QWEN, rope_theta=..., rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    assert config_from_hf(d).rope == RopeConfig(theta=1e6)


def test_yarn_defaults():
    d = hf(DS, rope_scaling={"type": "yarn", "factor": 2})
    r = config_from_hf(d).rope
    assert r.kind == "yarn" and r.factor == 2.0
    assert r.original_max_position_embeddings == d["max_position_embeddings"]
    assert (r.beta_fast, r.beta_slow, r.mscale, r.mscale_all_dim, r.attention_factor) == (32.0, 1.0, 0.0, 0.0, None)


def test_yarn_attention_factor_is_a_float():
    r = config_from_hf(hf(QWEN, rope_scaling={"type": "yarn", "factor": 4, "attention_factor": 1})).rope
    assert r.attention_factor == 1.0 and isinstance(r.attention_factor, float)


# ---- rejections ---------------------------------------------------------------------------------------

BAD = [
    # (preset, changes, text the message must contain)
    (QWEN, {"model_type": "llama"}, "model_type 'llama'"),
    (QWEN, {"model_type": ...}, "model_type None"),
    (QWEN, {"hidden_size": ...}, "'hidden_size'"),
    (DS, {"kv_lora_rank": ...}, "'kv_lora_rank'"),
    (QWEN, {"num_experts": ...}, "'num_experts'"),
    (DS, {"n_routed_experts": ...}, "'n_routed_experts'"),
    (QWEN, {"hidden_size": "64"}, "'hidden_size' must be an integer"),
    (QWEN, {"num_hidden_layers": 3.0}, "'num_hidden_layers' must be an integer"),
    (QWEN, {"num_experts": True}, "'num_experts' must be an integer"),
    (QWEN, {"head_dim": 16.5}, "'head_dim' must be an integer"),
    (QWEN, {"intermediate_size": "96"}, "'intermediate_size' must be an integer"),
    (DS, {"q_lora_rank": "32"}, "'q_lora_rank' must be an integer"),
    (DS, {"n_group": 4.0}, "'n_group' must be an integer"),
    (QWEN, {"rms_norm_eps": "1e-6"}, "'rms_norm_eps' must be a number"),
    (QWEN, {"vocab_size": 0}, "'vocab_size' must be a positive integer"),
    (QWEN, {"num_attention_heads": 0}, "'num_attention_heads' must be a positive integer"),
    (QWEN, {"num_experts_per_tok": 0}, "'num_experts_per_tok' must be a positive integer"),
    (DS, {"n_routed_experts": 0}, "'n_routed_experts' must be a positive integer"),
    (QWEN, {"num_hidden_layers": 0}, "'num_hidden_layers' must be a positive integer"),
    (DS, {"num_hidden_layers": -1}, "'num_hidden_layers' must be a positive integer"),
    (QWEN, {"rms_norm_eps": 0.0}, "rms_norm_eps"),
    (QWEN, {"num_key_value_heads": 3}, "num_key_value_heads (3)"),
    (QWEN, {"num_key_value_heads": 8}, "num_key_value_heads (8)"),
    (QWEN, {"head_dim": 15}, "head_dim"),
    (QWEN, {"num_experts_per_tok": 9}, "num_experts_per_tok (9)"),
    (DS, {"num_experts_per_tok": 17}, "num_experts_per_tok (17)"),
    (DS, {"n_group": 3}, "n_group (3)"),
    (DS, {"n_group": 0}, "n_group (0)"),
    (DS, {"topk_group": 5}, "topk_group (5)"),
    (DS, {"topk_group": 0}, "topk_group (0)"),
    (DS, {"n_group": 16, "topk_group": 16}, "groups need >= 2 experts"),
    (DS, {"topk_group": 1, "num_experts_per_tok": 5}, "topk_group"),
    (DS, {"routed_scaling_factor": 0.0}, "routed_scaling_factor"),
    (DS, {"n_shared_experts": -1}, "n_shared_experts"),
    (QWEN, {"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope type 'linear'"),
    (DS, {"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope type 'dynamic'"),
    (QWEN, {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}}, "rope type 'llama3'"),
    (QWEN, {"rope_scaling": {"type": "yarn"}}, "'factor'"),
    (QWEN, {"rope_scaling": {"type": "yarn", "factor": "4"}}, "'factor' must be a number"),
    (QWEN, {"rope_scaling": {"type": "yarn", "factor": -1.0}}, "'factor' must be > 0"),
    (QWEN, {"rope_scaling": "yarn"}, "'rope_scaling' must be a JSON object"),
    (QWEN, {"rope_theta": "1e4"}, "'rope_theta' must be a number"),
    (QWEN, {"rope_theta": 0.0}, "rope_theta must be > 0"),
    (DS, {"quantization_config": {"quant_method": "fp8"}}, "'fp8' without weight_block_size"),
    (DS, {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
     "moe_intermediate_size (32) must be a multiple of quantization_config weight_block_size[0] (128)"),
    (QWEN, {"quantization_config": {"quant_method": "fp8", "weight_block_size": [32]}}, "weight_block_size must be"),
    (QWEN, {"quantization_config": {"quant_method": "fp8", "weight_block_size": [32, 0]}}, "weight_block_size must"),
    (QWEN, {"quantization_config": {"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [32, 32]}},
     "fmt 'e5m2'"),
    (QWEN, {"quantization_config": {"quant_method": "fp8", "activation_scheme": "static",
                                    "weight_block_size": [32, 32]}}, "activation_scheme 'static'"),
    (QWEN, {"quantization_config": {"quant_method": "awq"}}, "'awq'"),
    (QWEN, {"quantization_config": "gptq"}, "quantization_config 'gptq'"),
    (QWEN, {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    (QWEN, {"use_sliding_window": True}, "use_sliding_window"),
    (QWEN, {"attention_bias": True}, "attention_bias"),
    (DS, {"attention_bias": True}, "attention_bias"),
    (DS, {"scoring_func": "softmax"}, "scoring_func 'softmax'"),
    (DS, {"topk_method": "greedy"}, "topk_method 'greedy'"),
    (QWEN, {"decoder_sparse_step": 0}, "decoder_sparse_step"),
    (QWEN, {"mlp_only_layers": [3]}, "'mlp_only_layers' has 3"),
    (QWEN, {"mlp_only_layers": ["1"]}, "'mlp_only_layers' has '1'"),
    (QWEN, {"mlp_only_layers": 1}, "'mlp_only_layers' must be a list"),
    (QWEN, {"intermediate_size": ...}, "intermediate_size"),  # layer 1 is dense and needs it
    (DS, {"first_k_dense_replace": -1}, "first_k_dense_replace"),
    (QWEN, {"eos_token_id": "</s>"}, "'eos_token_id' must hold integers"),
    (QWEN, {"num_experts": ..., "num_local_experts": ...}, "'num_experts' (or 'num_local_experts')"),
    (QWEN, {"norm_topk_prob": "yes"}, "rejected by transformers' Qwen3MoeConfig"),
    (DS, {"rope_interleave": 3}, "rejected by transformers' DeepseekV3Config"),
]


@pytest.mark.parametrize("name, changes, text", BAD, ids=[f"{n}:{t}" for n, _, t in BAD])
def test_bad_config_is_rejected_naming_the_field(name, changes, text):
    with pytest.raises(ConfigError) as e:
        config_from_hf(hf(name, **changes))
    assert text in str(e.value)


def test_config_must_be_a_json_object():
    with pytest.raises(ConfigError, match="JSON object"):
        config_from_hf([preset_hf_config(QWEN)])


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


def test_load_config_broken_json(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_moe", ')
    with pytest.raises(ConfigError, match="not valid JSON") as e:
        load_config(tmp_path)
    assert "config.json" in str(e.value)


def test_load_config_binary_file(tmp_path):
    (tmp_path / "config.json").write_bytes(b"\xff\xfe\x00garbage\x80")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(tmp_path)


def test_load_config_json_array(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        load_config(tmp_path)


def test_load_config_missing(tmp_path):
    with pytest.raises(ConfigError, match="no config.json") as e:
        load_config(tmp_path)
    assert str(tmp_path) in str(e.value)
    with pytest.raises(ConfigError, match="no config.json"):
        load_config(tmp_path / "does-not-exist")


def test_load_config_invalid_content_names_field(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(hf(DS, topk_group=7)))
    with pytest.raises(ConfigError, match=r"topk_group \(7\)"):
        load_config(tmp_path)


# ---- kimi_linear ------------------------------------------------------------------------------------

KIMI = "tiny-kimi-linear"


def _kimi_ref(d: dict):
    import transformers

    return transformers.KimiLinearConfig(**d)


def _assert_like_transformers(cfg: ModelConfig, ref) -> None:
    assert cfg.kda_layers == tuple(t == "linear_attention" for t in ref.layer_types)
    assert cfg.moe_layers == tuple(t == "sparse" for t in ref.mlp_layer_types)
    assert (cfg.num_experts, cfg.top_k, cfg.n_group, cfg.topk_group) == (
        ref.num_local_experts, ref.num_experts_per_tok, ref.n_group, ref.topk_group)
    assert (cfg.n_shared_experts, cfg.norm_topk_prob, cfg.routed_scaling_factor) == (
        ref.n_shared_experts, ref.norm_topk_prob, ref.routed_scaling_factor)
    assert (cfg.linear_num_heads, cfg.linear_head_dim, cfg.conv_kernel) == (
        ref.linear_num_heads, ref.linear_head_dim, ref.linear_conv_kernel_dim)
    assert (cfg.q_lora_rank, cfg.rms_norm_eps, cfg.max_position_embeddings) == (
        ref.q_lora_rank, ref.rms_norm_eps, ref.max_position_embeddings)


def test_kimi_linear_preset_values():
    cfg = preset_config(KIMI)
    assert cfg.family == "kimi_linear" and cfg.is_mla and not cfg.mla_rope
    assert cfg.kda_layers == (True, True, False, True) and cfg.moe_layers == (False, True, True, True)
    assert cfg.softmax_scale == (16 + 8) ** -0.5  # no yarn factor: no rope at all
    _assert_like_transformers(cfg, _kimi_ref(hf(KIMI)))


def test_kimi_linear_defaults_are_transformers():
    d = hf(KIMI, **{k: ... for k in ("linear_attn_config", "first_k_dense_replace", "n_group", "topk_group",
                                     "n_shared_experts", "norm_topk_prob", "routed_scaling_factor", "rms_norm_eps",
                                     "q_lora_rank", "max_position_embeddings", "num_experts_per_tok")})
    d.update(num_hidden_layers=9, linear_head_dim=16, linear_num_heads=2)
    cfg = config_from_hf(d)
    _assert_like_transformers(cfg, _kimi_ref(d))
    assert cfg.kda_layers == tuple(not (i and i % 4 == 0) for i in range(9))


def test_kimi_linear_aliases_are_transformers():
    """Kimi-Linear's own config.json spells several fields the way KimiLinearConfig's attribute_map does."""
    d = hf(KIMI, num_experts=..., num_experts_per_tok=..., n_group=..., n_shared_experts=..., norm_topk_prob=...,
           max_position_embeddings=...)
    d.update(num_local_experts=16, num_experts_per_token=2, num_expert_group=2, num_shared_experts=2,
             moe_renormalize=False, model_max_length=1024)
    cfg = config_from_hf(d)
    _assert_like_transformers(cfg, _kimi_ref(d))
    assert (cfg.num_experts, cfg.top_k, cfg.n_group, cfg.n_shared_experts, cfg.max_position_embeddings) == (
        16, 2, 2, 2, 1024)


def test_kimi_linear_layer_types_lists():
    d = hf(KIMI, layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"],
           mlp_layer_types=["sparse", "dense", "sparse", "sparse"])
    cfg = config_from_hf(d)
    _assert_like_transformers(cfg, _kimi_ref(d))
    assert cfg.kda_layers == (False, True, True, False) and cfg.moe_layers == (True, False, True, True)


KIMI_BAD = [
    ({"layer_types": ["linear_attention"]}, "layer_types"),
    ({"mlp_layer_types": ["dense", "moe", "sparse", "sparse"]}, "mlp_layer_types"),
    ({"linear_attn_config": {"full_attn_layers": [0], "kda_layers": [1, 2, 3]}}, "'full_attn_layers' must list"),
    ({"linear_attn_config": {"full_attn_layers": [3], "kda_layers": [1, 2, 4], "short_conv_kernel_size": 1}},
     "short_conv_kernel_size"),
    ({"n_shared_experts": 0}, "num_shared_experts"),
    ({"attention_bias": True}, "attention_bias"),
]


@pytest.mark.parametrize("changes, text", KIMI_BAD, ids=[t for _, t in KIMI_BAD])
def test_kimi_linear_bad_config_is_rejected(changes, text):
    with pytest.raises(ConfigError) as e:
        config_from_hf(hf(KIMI, **changes))
    assert text in str(e.value)
