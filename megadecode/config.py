"""Model configuration: one validated dataclass for every supported family, read from HF config.json.

Families:
  qwen3_moe    GQA + RoPE with q/k RMSNorm, softmax router, top-k, optional renormalisation.
  deepseek_v3  MLA (absorbed decode), sigmoid router with a selection-only correction bias
               (`noaux_tc`), expert groups, renormalisation, routed scaling, shared experts,
               the first `first_k_dense_replace` layers dense. `kimi_k2` is the same architecture.
  kimi_linear  hybrid: KDA layers (Kimi Delta Attention: short causal conv over q/k/v, gated delta rule
               with a per-channel decay, gated RMSNorm output) and MLA layers without positional
               encoding (the `qk_rope_head_dim` part of the key is shared across heads but never
               rotated); DeepSeek-style MoE (sigmoid, selection bias, groups), shared experts
               (parsed in `config_kimi_linear.py`).
  kimi_k3      hybrid KDA + gated NoPE MLA, Block Attention Residuals, Stable LatentMoE with MXFP4 routed
               experts; no transformers class exists, so its config.json fields are ours (parsed in
               `config_k3.py`, every open choice documented in `megadecode/k3.md`).

A field left out of config.json takes the default of transformers' config class for the family
(Qwen3MoeConfig, DeepseekV3Config, KimiLinearConfig; kimi_k3: the public K3 values), so the model built is the
one transformers would build; the fields that define the model's size have no default and are required.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

FAMILIES = ("qwen3_moe", "deepseek_v3", "kimi_linear", "kimi_k3")
# HF `model_type` -> our family.
MODEL_TYPES = {"qwen3_moe": "qwen3_moe", "deepseek_v3": "deepseek_v3", "kimi_k2": "deepseek_v3",
               "kimi_linear": "kimi_linear", "kimi_k3": "kimi_k3"}


class ConfigError(ValueError):
    """A config.json that megadecode cannot run, with the reason."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    kind: str = "default"  # "default" | "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    # MoE
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    moe_layers: tuple[bool, ...]  # per layer: routed MoE (True) or dense MLP (False)
    intermediate_size: int = 0  # dense MLP width
    score_func: str = "softmax"  # "softmax" | "sigmoid"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0
    # GQA attention (qwen3_moe)
    num_kv_heads: int = 0
    head_dim: int = 0
    # MLA attention (deepseek_v3)
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = True
    mla_rope: bool = True  # False (kimi_linear): MLA keys/queries are never rotated (NoPE)
    # KDA (kimi_linear): per layer, True = KDA (linear attention), False = the family's softmax attention.
    kda_layers: tuple[bool, ...] = ()
    linear_num_heads: int = 0
    linear_head_dim: int = 0  # key and value head dim of KDA layers
    conv_kernel: int = 0  # short causal conv width over q/k/v
    # kimi_k3 (see megadecode/k3.md): Stable LatentMoE, gated MLA, Block Attention Residuals.
    latent_size: int = 0  # > 0: MoE layers are LatentMoE (routed experts run in this width)
    expert_act: str = "silu"  # routed experts' GLU activation: "silu" | "situ" (SiTU-GLU)
    expert_quant: str | None = None  # None (dense float experts) | "mxfp4" (packed uint8 in memory)
    mla_output_gate: bool = False  # o = o_proj(attn * sigmoid(x W_gate^T))
    attn_res_block_size: int = 0  # > 0: Block Attention Residuals with blocks of this many layers
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    hf: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(msg)

        need(self.family in FAMILIES, f"unsupported family {self.family!r}; supported: {FAMILIES}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_experts", "top_k",
                     "moe_intermediate_size", "max_position_embeddings"):
            v = getattr(self, name)
            need(isinstance(v, int) and v > 0, f"{name} must be a positive integer, got {v!r}")
        need(self.top_k <= self.num_experts,
             f"num_experts_per_tok ({self.top_k}) exceeds the number of experts ({self.num_experts})")
        need(len(self.moe_layers) == self.num_layers, "moe_layers must have one entry per layer")
        need(self.rms_norm_eps > 0, f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        need(self.score_func in ("softmax", "sigmoid"), f"unknown scoring function {self.score_func!r}")
        if not all(self.moe_layers):
            need(self.intermediate_size > 0, "dense layers need intermediate_size > 0")
        need(self.n_group >= 1 and self.num_experts % self.n_group == 0,
             f"n_routed_experts ({self.num_experts}) must divide into n_group ({self.n_group}) groups")
        need(1 <= self.topk_group <= self.n_group, f"topk_group ({self.topk_group}) must be in [1, n_group]")
        need(self.n_shared_experts >= 0, f"n_shared_experts must be >= 0, got {self.n_shared_experts}")
        if self.n_group > 1:
            need(self.num_experts // self.n_group >= 2, "expert groups need >= 2 experts each (group score = top-2 sum)")
            need(self.topk_group * (self.num_experts // self.n_group) >= self.top_k,
                 "topk_group groups hold fewer experts than num_experts_per_tok")
        need(self.rope.theta > 0, "rope_theta must be > 0")
        if self.family == "qwen3_moe":
            need(self.num_kv_heads > 0 and self.num_heads % self.num_kv_heads == 0,
                 f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads "
                 f"({self.num_kv_heads})")
            need(self.head_dim > 0 and self.head_dim % 2 == 0, f"head_dim must be even and > 0, got {self.head_dim}")
        else:
            need(self.kv_lora_rank > 0, "kv_lora_rank must be > 0")
            if self.mla_rope:
                need(self.qk_rope_head_dim > 0 and self.qk_rope_head_dim % 2 == 0,
                     "qk_rope_head_dim must be even and > 0")
            else:
                need(self.qk_rope_head_dim >= 0, "qk_rope_head_dim must be >= 0")
            need(self.qk_nope_head_dim > 0 and self.v_head_dim > 0, "qk_nope_head_dim and v_head_dim must be > 0")
            need(self.q_lora_rank is None or self.q_lora_rank > 0, "q_lora_rank must be > 0 or null")
        need(not self.kda_layers or len(self.kda_layers) == self.num_layers, "kda_layers must have one entry per layer")
        if any(self.kda_layers):
            need(self.linear_num_heads > 0 and self.linear_head_dim > 0,
                 "KDA layers need linear_attn_config num_heads and head_dim > 0")
            need(self.conv_kernel >= 2, f"short_conv_kernel_size must be >= 2, got {self.conv_kernel}")
        if self.family == "kimi_k3":
            from .config_k3 import check_k3
            check_k3(self)
        if self.family == "kimi_linear":
            need(self.n_shared_experts >= 1 or not any(self.moe_layers),
                 "kimi_linear MoE layers always run a shared expert: num_shared_experts must be >= 1")
        need(self.routed_scaling_factor > 0 and math.isfinite(self.routed_scaling_factor),
             f"routed_scaling_factor must be a finite number > 0, got {self.routed_scaling_factor}")
        for t in self.eos_token_id:
            need(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size,
                 f"eos_token_id {t!r} outside the vocabulary [0, {self.vocab_size})")
        if self.bos_token_id is not None:
            t = self.bos_token_id
            need(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size,
                 f"bos_token_id {t!r} outside the vocabulary [0, {self.vocab_size})")

    # ---- derived sizes ------------------------------------------------------------------------
    @property
    def is_mla(self) -> bool:
        return self.family in ("deepseek_v3", "kimi_linear", "kimi_k3")

    def is_kda(self, layer: int) -> bool:
        return bool(self.kda_layers) and self.kda_layers[layer]

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def rope_dim(self) -> int:
        return self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def cache_width(self) -> int:
        """Values cached per token per layer: 512+64 latent for MLA, 2*kv_heads*head_dim for GQA."""
        return self.kv_lora_rank + self.qk_rope_head_dim if self.is_mla else 2 * self.num_kv_heads * self.head_dim

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim ** -0.5
        r = self.rope
        if self.is_mla and self.mla_rope and r.kind == "yarn" and r.mscale_all_dim:
            m = yarn_mscale(r.factor, r.mscale_all_dim)
            scale *= m * m
        return scale

    @property
    def shared_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.n_shared_experts

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "hf"}


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _get(d: dict, key: str, default: Any = ..., *, type_=None) -> Any:
    if key not in d or d[key] is None:
        if default is ...:
            raise ConfigError(f"config.json is missing the required field {key!r}")
        return default
    v = d[key]
    if type_ is int and (isinstance(v, bool) or not isinstance(v, int)):
        raise ConfigError(f"config field {key!r} must be an integer, got {v!r}")
    if type_ is float and (isinstance(v, bool) or not isinstance(v, (int, float))):
        raise ConfigError(f"config field {key!r} must be a number, got {v!r}")
    return v


def _rope_from_hf(d: dict, head_dim: int) -> RopeConfig:
    # transformers 5 writes `rope_parameters`; older files have `rope_theta` + `rope_scaling`.
    for key in ("rope_parameters", "rope_scaling"):
        if d.get(key) is not None and not isinstance(d[key], dict):
            raise ConfigError(f"config field {key!r} must be a JSON object, got {d[key]!r}")
    params = dict(d.get("rope_parameters") or {})
    if d.get("rope_scaling"):
        params = {**d["rope_scaling"], **params}
    if "rope_theta" not in params and "rope_theta" in d:
        params["rope_theta"] = d["rope_theta"]

    def num(key: str, default: Any = ...) -> float:
        v = _get(params, key, default, type_=float)
        if v is None:
            return None
        if not math.isfinite(v):
            raise ConfigError(f"rope field {key!r} must be finite, got {v!r}")
        return float(v)

    theta = num("rope_theta", 10000.0)
    if theta <= 0:
        raise ConfigError(f"rope_theta must be > 0, got {theta}")
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind not in ("default", "yarn"):
        raise ConfigError(f"unsupported rope type {kind!r}; supported: default, yarn")
    if kind == "default":
        return RopeConfig(theta=theta)
    if params.get("factor") is None:
        raise ConfigError("yarn rope scaling needs a 'factor'")
    factor = num("factor")
    if factor <= 0:
        raise ConfigError(f"yarn rope 'factor' must be > 0, got {factor}")
    orig = _get(params, "original_max_position_embeddings", None, type_=int)
    if orig is None:
        orig = _get(d, "max_position_embeddings", 4096, type_=int)
    if orig <= 0:
        raise ConfigError(f"rope original_max_position_embeddings must be > 0, got {orig}")
    return RopeConfig(
        theta=theta, kind="yarn", factor=factor, original_max_position_embeddings=orig,
        # 0/null betas mean the defaults, as in transformers (`get("beta_fast") or 32`).
        beta_fast=num("beta_fast", None) or 32.0, beta_slow=num("beta_slow", None) or 1.0,
        mscale=num("mscale", 0.0), mscale_all_dim=num("mscale_all_dim", 0.0),
        attention_factor=num("attention_factor", None), truncate=bool(params.get("truncate", True)),
    )


def _eos(d: dict) -> tuple[int, ...]:
    e = d.get("eos_token_id")
    if e is None:
        return ()
    ids = tuple(e) if isinstance(e, (list, tuple)) else (e,)
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int):
            raise ConfigError(f"config field 'eos_token_id' must hold integers, got {e!r}")
    return ids


def _layer_list(d: dict, key: str, num_layers: int) -> set[int]:
    v = d.get(key)
    if v is None:
        return set()
    if not isinstance(v, (list, tuple)):
        raise ConfigError(f"config field {key!r} must be a list of layer indices, got {v!r}")
    for i in v:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_layers:
            raise ConfigError(f"config field {key!r} has {i!r}, not a layer index in [0, {num_layers})")
    return set(v)


def config_from_hf(d: dict) -> ModelConfig:
    """Build and validate a ModelConfig from the dict of an HF config.json."""
    if not isinstance(d, dict):
        raise ConfigError("config.json must hold a JSON object")
    mt = d.get("model_type")
    if mt not in MODEL_TYPES:
        raise ConfigError(f"unsupported model_type {mt!r}; supported: {sorted(MODEL_TYPES)}")
    family = MODEL_TYPES[mt]
    if family == "kimi_k3":
        from .config_k3 import kimi_k3_from_hf
        return kimi_k3_from_hf(d)
    if d.get("quantization_config"):
        q = d["quantization_config"]
        method = q.get("quant_method", q) if isinstance(q, dict) else q
        raise ConfigError(f"quantized checkpoints (quantization_config {method!r}) are not supported for {mt}; "
                          "convert the weights to bf16 first")
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"hidden_act {act!r} is not supported (only 'silu')")
    L = _get(d, "num_hidden_layers", type_=int)
    if family == "kimi_linear":
        from .config_kimi_linear import kimi_linear_from_hf

        return kimi_linear_from_hf(d, L)
    common = dict(
        vocab_size=_get(d, "vocab_size", type_=int), hidden_size=_get(d, "hidden_size", type_=int),
        num_layers=L, num_heads=_get(d, "num_attention_heads", type_=int),
        rms_norm_eps=float(_get(d, "rms_norm_eps", 1e-6, type_=float)),
        max_position_embeddings=_get(d, "max_position_embeddings", type_=int),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        bos_token_id=_get(d, "bos_token_id", None, type_=int), eos_token_id=_eos(d), hf=dict(d),
    )
    if family == "qwen3_moe":
        if d.get("use_sliding_window"):
            raise ConfigError("use_sliding_window=true is not supported for qwen3_moe")
        if d.get("attention_bias"):
            raise ConfigError("attention_bias=true is not supported for qwen3_moe")
        heads = common["num_heads"]
        head_dim = _get(d, "head_dim", common["hidden_size"] // heads if heads > 0 else 0, type_=int)
        step = _get(d, "decoder_sparse_step", 1, type_=int)
        if step < 1:
            raise ConfigError(f"decoder_sparse_step must be >= 1, got {step}")
        mlp_only = _layer_list(d, "mlp_only_layers", L)
        E = _get(d, "num_experts", type_=int)
        moe = tuple(i not in mlp_only and (i + 1) % step == 0 for i in range(L))
        return ModelConfig(
            family=family, **common, rope=_rope_from_hf(d, head_dim),
            num_experts=E, top_k=_get(d, "num_experts_per_tok", type_=int),
            moe_intermediate_size=_get(d, "moe_intermediate_size", type_=int),
            intermediate_size=_get(d, "intermediate_size", 0, type_=int),
            norm_topk_prob=bool(d.get("norm_topk_prob", False)), moe_layers=moe, score_func="softmax",
            num_kv_heads=_get(d, "num_key_value_heads", 4, type_=int), head_dim=head_dim,  # Qwen3MoeConfig
        )
    # deepseek_v3 / kimi_k2
    if d.get("attention_bias"):
        raise ConfigError("attention_bias=true is not supported for deepseek_v3")
    scoring = d.get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise ConfigError(f"scoring_func {scoring!r} is not supported for deepseek_v3 (only 'sigmoid')")
    topk_method = d.get("topk_method", "noaux_tc")
    if topk_method != "noaux_tc":
        raise ConfigError(f"topk_method {topk_method!r} is not supported (only 'noaux_tc')")
    # Defaults below are DeepseekV3Config's.
    first_dense = _get(d, "first_k_dense_replace", 3, type_=int)
    if first_dense < 0:
        raise ConfigError(f"first_k_dense_replace must be >= 0, got {first_dense}")
    rope_dim = _get(d, "qk_rope_head_dim", type_=int)
    return ModelConfig(
        family=family, **common, rope=_rope_from_hf(d, rope_dim),
        num_experts=_get(d, "n_routed_experts", type_=int), top_k=_get(d, "num_experts_per_tok", type_=int),
        moe_intermediate_size=_get(d, "moe_intermediate_size", type_=int),
        intermediate_size=_get(d, "intermediate_size", type_=int),
        norm_topk_prob=bool(d.get("norm_topk_prob", True)),
        # transformers' DeepseekV3 makes every layer from `first_k_dense_replace` on a MoE layer.
        moe_layers=tuple(i >= first_dense for i in range(L)), score_func="sigmoid",
        n_group=_get(d, "n_group", 8, type_=int), topk_group=_get(d, "topk_group", 4, type_=int),
        routed_scaling_factor=float(_get(d, "routed_scaling_factor", 2.5, type_=float)),
        n_shared_experts=_get(d, "n_shared_experts", 1, type_=int),
        # null: queries projected directly (no low-rank q); absent: DeepseekV3Config's 1536.
        q_lora_rank=(None if "q_lora_rank" in d and d["q_lora_rank"] is None
                     else _get(d, "q_lora_rank", 1536, type_=int)),
        kv_lora_rank=_get(d, "kv_lora_rank", type_=int),
        qk_nope_head_dim=_get(d, "qk_nope_head_dim", type_=int), qk_rope_head_dim=rope_dim,
        v_head_dim=_get(d, "v_head_dim", type_=int), rope_interleave=bool(d.get("rope_interleave", True)),
        num_kv_heads=_get(d, "num_key_value_heads", common["num_heads"], type_=int),
    )


def load_config(path: str | Path) -> ModelConfig:
    """Read `config.json` from a checkpoint directory (or the file itself)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ConfigError(f"no config.json at {p}")
    try:
        d = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{p} is not valid JSON: {e}") from None
    except OSError as e:
        raise ConfigError(f"cannot read {p}: {e}") from None
    return config_from_hf(d)
