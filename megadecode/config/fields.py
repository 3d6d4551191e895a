"""Readers of HF config.json fields, shared by the family parsers: typed, with defaults, clear errors."""

from __future__ import annotations

import math
from typing import Any

from .model import ConfigError, RopeConfig


def hf_field(d: dict, key: str, default: Any = ..., *, type_=None) -> Any:
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


def hf_num_layers(d: dict) -> int:
    """`num_hidden_layers`, checked before the per-layer lists that are read against it."""
    L = hf_field(d, "num_hidden_layers", type_=int)
    if L < 1:
        raise ConfigError(f"config field 'num_hidden_layers' must be a positive integer, got {L}")
    return L


def hf_rope(d: dict, head_dim: int) -> RopeConfig:
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
        v = hf_field(params, key, default, type_=float)
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
    orig = hf_field(params, "original_max_position_embeddings", None, type_=int)
    if orig is None:
        orig = hf_field(d, "max_position_embeddings", 4096, type_=int)
    if orig <= 0:
        raise ConfigError(f"rope original_max_position_embeddings must be > 0, got {orig}")
    return RopeConfig(
        theta=theta, kind="yarn", factor=factor, original_max_position_embeddings=orig,
        # 0/null betas mean the defaults, as in transformers (`get("beta_fast") or 32`).
        beta_fast=num("beta_fast", None) or 32.0, beta_slow=num("beta_slow", None) or 1.0,
        mscale=num("mscale", 0.0), mscale_all_dim=num("mscale_all_dim", 0.0),
        attention_factor=num("attention_factor", None), truncate=bool(params.get("truncate", True)),
    )


def hf_eos(d: dict) -> tuple[int, ...]:
    e = d.get("eos_token_id")
    if e is None:
        return ()
    ids = tuple(e) if isinstance(e, (list, tuple)) else (e,)
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int):
            raise ConfigError(f"config field 'eos_token_id' must hold integers, got {e!r}")
    return ids


def hf_layer_list(d: dict, key: str, num_layers: int) -> set[int]:
    v = d.get(key)
    if v is None:
        return set()
    if not isinstance(v, (list, tuple)):
        raise ConfigError(f"config field {key!r} must be a list of layer indices, got {v!r}")
    for i in v:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_layers:
            raise ConfigError(f"config field {key!r} has {i!r}, not a layer index in [0, {num_layers})")
    return set(v)




def hf_alias(d: dict, names: tuple[str, ...], default: Any = ..., *, type_=None) -> Any:
    """The first of several spellings of one field present in `d` (KimiLinearConfig's attribute_map)."""
    for n in names:
        if d.get(n) is not None:
            return hf_field(d, n, type_=type_)
    return hf_field(d, names[0], default, type_=type_)




def reject_quantized(d: dict, model_type: str) -> None:
    """Float families load float weights only."""
    if d.get("quantization_config"):
        q = d["quantization_config"]
        method = q.get("quant_method", q) if isinstance(q, dict) else q
        raise ConfigError(f"quantized checkpoints (quantization_config {method!r}) are not supported for "
                          f"{model_type}; convert the weights to bf16 first")


def require_silu(d: dict) -> None:
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"hidden_act {act!r} is not supported (only 'silu')")


def common_fields(d: dict, L: int) -> dict:
    """The fields every GQA/MLA family reads the same way."""
    return dict(
        vocab_size=hf_field(d, "vocab_size", type_=int), hidden_size=hf_field(d, "hidden_size", type_=int),
        num_layers=L, num_heads=hf_field(d, "num_attention_heads", type_=int),
        rms_norm_eps=float(hf_field(d, "rms_norm_eps", 1e-6, type_=float)),
        max_position_embeddings=hf_field(d, "max_position_embeddings", type_=int),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        bos_token_id=hf_field(d, "bos_token_id", None, type_=int), eos_token_id=hf_eos(d), hf=dict(d),
    )
