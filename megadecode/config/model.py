"""ModelConfig: one validated dataclass for every supported family (what the rest of megadecode reads).

Families:
  qwen3_moe    GQA + RoPE with q/k RMSNorm, softmax router, top-k, optional renormalisation.
  deepseek_v3  MLA (absorbed decode), sigmoid router with a selection-only correction bias
               (`noaux_tc`), expert groups, renormalisation, routed scaling, shared experts,
               the first `first_k_dense_replace` layers dense; optional multi-token-prediction layers
               after the last (`num_mtp_layers`). `kimi_k2` is the same architecture.
  kimi_linear  hybrid: KDA layers (Kimi Delta Attention: short causal conv over q/k/v, gated delta rule
               with a per-channel decay, gated RMSNorm output) and MLA layers without positional
               encoding (the `qk_rope_head_dim` part of the key is shared across heads but never
               rotated); DeepSeek-style MoE (sigmoid, selection bias, groups), shared experts.
  kimi_k3      hybrid KDA + gated NoPE MLA, Block Attention Residuals, Stable LatentMoE with MXFP4 routed
               experts (every open choice documented in `megadecode/k3.md`).

The HF config.json parsers (one module per family, registered in `config/__init__.py`) build it; its
`__post_init__` checks the invariants every family shares, and K3's own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields


class ConfigError(ValueError):
    """A config.json that megadecode cannot run, with the reason."""


class ConfigWarning(UserWarning):
    """Something in a config.json that megadecode runs anyway, ignoring it (the CLI prints `megadecode: warning:`)."""


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


# ModelConfig fields whose config.json name differs (for every family; num_experts: ModelConfig.hf_name).
_HF_NAMES = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads", "top_k": "num_experts_per_tok",
             "num_kv_heads": "num_key_value_heads"}


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
    expert_quant: str | None = None  # None (float experts) | "mxfp4" (K3: packed uint8) | "fp8" (float8_e4m3fn)
    # FP8 block-scaled checkpoints (quantization_config weight_block_size): one weight_scale_inv per block of
    # (rows, cols) weights. Routed experts stay FP8 in memory; every other weight is dequantized at load.
    weight_block: tuple[int, int] | None = None
    mla_output_gate: bool = False  # o = o_proj(attn * sigmoid(x W_gate^T))
    attn_res_block_size: int = 0  # > 0: Block Attention Residuals with blocks of this many layers
    tie_word_embeddings: bool = False
    # DeepSeek-V3's multi-token-prediction (MTP) layers after the last layer (config.json num_nextn_predict_layers):
    # not part of the decode step; the MTP drafter's (megadecode/mtp.py)
    num_mtp_layers: int = 0
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    hf: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(msg)

        from .registry import FAMILIES

        need(self.family in FAMILIES, f"unsupported family {self.family!r}; supported: {FAMILIES}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_experts", "top_k",
                     "moe_intermediate_size", "max_position_embeddings"):
            v = getattr(self, name)
            need(isinstance(v, int) and v > 0, f"config field {self.hf_name(name)!r} must be a positive integer, "
                                               f"got {v!r}")
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
            _check_k3(self)
        else:
            need(self.expert_quant in (None, "fp8"), f"routed experts of {self.family} are float or FP8, got "
                                                     f"expert_quant {self.expert_quant!r}")
        if self.expert_quant == "fp8":
            blk = self.weight_block
            need(isinstance(blk, tuple) and len(blk) == 2 and all(isinstance(b, int) and b > 0 for b in blk),
                 f"FP8 weights need a weight_block_size of two positive integers, got {blk!r}")
            need(self.moe_intermediate_size % blk[0] == 0,
                 f"FP8 experts keep the scale grids of gate and up stacked, so moe_intermediate_size "
                 f"({self.moe_intermediate_size}) must be a multiple of quantization_config weight_block_size[0] "
                 f"({blk[0]})")
        if self.family == "kimi_linear":
            need(self.n_shared_experts >= 1 or not any(self.moe_layers),
                 "kimi_linear MoE layers always run a shared expert: num_shared_experts must be >= 1")
        need(isinstance(self.num_mtp_layers, int) and not isinstance(self.num_mtp_layers, bool)
             and self.num_mtp_layers >= 0,
             f"num_nextn_predict_layers must be an integer >= 0, got {self.num_mtp_layers!r}")
        need(self.routed_scaling_factor > 0 and math.isfinite(self.routed_scaling_factor),
             f"routed_scaling_factor must be a finite number > 0, got {self.routed_scaling_factor}")
        for t in self.eos_token_id:
            need(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size,
                 f"eos_token_id {t!r} outside the vocabulary [0, {self.vocab_size})")
        if self.bos_token_id is not None:
            t = self.bos_token_id
            need(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size,
                 f"bos_token_id {t!r} outside the vocabulary [0, {self.vocab_size})")

    def hf_name(self, name: str) -> str:
        """The config.json field a ModelConfig field is read from (error messages name what the user wrote)."""
        if name == "num_experts":
            return "n_routed_experts" if self.family == "deepseek_v3" else "num_experts"
        if name == "num_mtp_layers":
            return "num_nextn_predict_layers"
        return _HF_NAMES.get(name, name)

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


def _check_k3(cfg: ModelConfig) -> None:
    """kimi_k3 invariants (called from ModelConfig.__post_init__)."""
    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise ConfigError(f"kimi_k3: {msg}")

    need(cfg.latent_size > 0, f"latent_size must be a positive integer, got {cfg.latent_size!r}")
    need(cfg.latent_size % 32 == 0 and cfg.moe_intermediate_size % 32 == 0,
         f"MXFP4 experts pack 32 weights per scale along their input dim: latent_size ({cfg.latent_size}) and "
         f"moe_intermediate_size ({cfg.moe_intermediate_size}) must be multiples of 32")
    need(cfg.expert_act in ("silu", "situ"), f"moe_hidden_act must be 'situ' or 'silu', got {cfg.expert_act!r}")
    need(cfg.expert_quant == "mxfp4", f"routed experts must be MXFP4, got expert_quant {cfg.expert_quant!r}")
    need(cfg.score_func == "sigmoid", "Stable LatentMoE routes with sigmoid scores")
    need(isinstance(cfg.attn_res_block_size, int) and cfg.attn_res_block_size >= 0,
         f"attn_res_block_size must be an integer >= 0 (0: no AttnRes), got {cfg.attn_res_block_size!r}")
    need(cfg.n_shared_experts >= 1 or not any(cfg.moe_layers),
         "LatentMoE layers run shared experts: num_shared_experts must be >= 1")
