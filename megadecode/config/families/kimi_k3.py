"""kimi_k3 config.json: our field names (no transformers class exists), K3's public values as defaults.

Fields shared with kimi_linear keep kimi_linear's names and meaning (`layer_types` or
`linear_attn_config`, the MLA dims, `first_k_dense_replace`, `num_experts`, `num_experts_per_tok`,
`num_shared_experts`, `n_group`, ...); `families.kimi_linear.build` parses them after the K3 defaults below are
filled in. K3-only fields:
  latent_size           int, required   LatentMoE latent width (3584)
  moe_hidden_act        "situ"          routed experts' GLU: "situ" (SiTU-GLU) or "silu" (SwiGLU)
  attn_res_block_size   12              Block Attention Residuals: layers per block (0: off, plain residual)
  mla_output_gate       true            MLA output gate o_proj(attn * sigmoid(x W_gate^T))
  quantization_config   absent, or compressed-tensors with format "mxfp4-pack-quantized": the routed
                        experts are always MXFP4 (packed uint8 + e8m0 scales); everything else is float.
Required (they set the model's size): vocab_size, hidden_size, num_hidden_layers, num_attention_heads,
num_experts, num_experts_per_tok, moe_intermediate_size, latent_size.
Default layer kinds (no `layer_types` and no `linear_attn_config` layer lists): every 4th layer
(1-indexed 4, 8, ...) and the last layer are MLA, the rest KDA: 93 layers -> 69 KDA + 24 MLA.
Choices the public description leaves open are listed in megadecode/k3.md.
"""

from __future__ import annotations

import dataclasses

from ..fields import hf_field, hf_num_layers
from ..model import ConfigError, ModelConfig
from . import kimi_linear

REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_experts",
            "num_experts_per_tok", "moe_intermediate_size", "latent_size")
# K3's public values (SPEC.md), used where config.json leaves a field out.
DEFAULTS = {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
            "v_head_dim": 128, "intermediate_size": 33792, "first_k_dense_replace": 1, "n_group": 1,
            "topk_group": 1, "routed_scaling_factor": 1.0, "norm_topk_prob": True, "rms_norm_eps": 1e-5}
LINEAR_DEFAULTS = {"num_heads": 96, "head_dim": 128, "short_conv_kernel_size": 4}
MXFP4_FORMAT = "mxfp4-pack-quantized"


def default_layer_types(num_layers: int) -> list[str]:
    return ["full_attention" if (i + 1) % 4 == 0 or i == num_layers - 1 else "linear_attention"
            for i in range(num_layers)]


def parse(d: dict) -> ModelConfig:
    for key in REQUIRED:
        hf_field(d, key)  # raises "missing the required field"
    if d.get("attention_bias"):
        raise ConfigError("attention_bias=true is not supported for kimi_k3")
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"hidden_act {act!r} is not supported for kimi_k3 (only 'silu': the dense layer and "
                          "the shared experts are SwiGLU)")
    if d.get("shared_expert_act", "silu") != "silu":
        raise ConfigError(f"shared_expert_act {d['shared_expert_act']!r} is not supported (only 'silu')")
    q = d.get("quantization_config")
    if q is not None:
        if not isinstance(q, dict) or q.get("quant_method") != "compressed-tensors" or \
                q.get("format", MXFP4_FORMAT) != MXFP4_FORMAT:
            raise ConfigError(f"kimi_k3 quantization_config must be compressed-tensors with format "
                              f"{MXFP4_FORMAT!r} (MXFP4 routed experts), got {q!r}")
    merged = {**DEFAULTS, **{k: v for k, v in d.items() if v is not None or k == "q_lora_rank"}}
    if d.get("num_shared_experts") is None and d.get("n_shared_experts") is None:
        merged["num_shared_experts"] = 2  # two full-width shared experts, combined 2 x moe_intermediate_size
    lin = d.get("linear_attn_config") or {}
    if not isinstance(lin, dict):
        raise ConfigError(f"config field 'linear_attn_config' must be a JSON object, got {lin!r}")
    merged["linear_attn_config"] = {**LINEAR_DEFAULTS, **lin}
    L = hf_num_layers(d)
    if merged.get("layer_types") is None and not ("full_attn_layers" in lin and "kda_layers" in lin):
        merged["layer_types"] = default_layer_types(L)
    base = kimi_linear.build(merged, L)
    expert_act = d.get("moe_hidden_act", "situ")
    gate = d.get("mla_output_gate", True)
    if not isinstance(gate, bool):
        raise ConfigError(f"config field 'mla_output_gate' must be true or false, got {gate!r}")
    return dataclasses.replace(
        base, family="kimi_k3", hf=dict(d), latent_size=hf_field(d, "latent_size", type_=int),
        expert_act=expert_act, expert_quant="mxfp4", mla_output_gate=gate,
        attn_res_block_size=hf_field(d, "attn_res_block_size", 12, type_=int))
