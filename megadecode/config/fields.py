"""Readers of HF config.json fields, shared by the family parsers: typed, with defaults, clear errors."""

from __future__ import annotations

import math
import warnings
from typing import Any

from .model import ConfigError, ConfigWarning, RopeConfig


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


def hf_quantization(d: dict, model_type: str) -> tuple[str | None, tuple[int, int] | None]:
    """`quantization_config` -> (expert_quant, weight_block): (None, None) for float checkpoints, ("fp8",
    (rows, cols)) for FP8 block-scaled ones as DeepSeek-V3, Kimi K2 and Qwen3-*-FP8 ship them
    (`{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}`:
    float8_e4m3fn weights, one `weight_scale_inv` per block of rows x cols). Anything else is refused."""
    q = d.get("quantization_config")
    if not q:
        return None, None
    method = q.get("quant_method", q) if isinstance(q, dict) else q
    if method != "fp8":
        raise ConfigError(f"quantized checkpoints (quantization_config {method!r}) are not supported for "
                          f"{model_type}: only FP8 block-scaled ones (quant_method 'fp8' with weight_block_size); "
                          f"convert the weights to bf16 first")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"quantization_config fmt {fmt!r} is not supported (only 'e4m3': float8_e4m3fn weights)")
    scheme = q.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ConfigError(f"quantization_config activation_scheme {scheme!r} is not supported (only 'dynamic': "
                          f"megadecode keeps activations unquantized and reads no activation scales)")
    block = q.get("weight_block_size")
    if block is None:
        raise ConfigError("quantization_config 'fp8' without weight_block_size (per-tensor FP8) is not supported: "
                          "only block-scaled FP8 (e.g. weight_block_size [128, 128])")
    if not (isinstance(block, (list, tuple)) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ConfigError(f"quantization_config weight_block_size must be two positive integers [rows, cols], "
                          f"got {block!r}")
    return "fp8", (block[0], block[1])


def hf_special_tokens(d: dict, vocab_size: int) -> tuple[int | None, tuple[int, ...]]:
    """(bos_token_id, eos_token_id) of config.json. An id outside [0, vocab_size) is a warning and is dropped
    (a stop token the model can never produce stops nothing; nothing reads bos): a small model made with a
    family's default special tokens (Kimi-Linear's eos 163586 with a vocabulary of 259) runs as it is."""
    bos = hf_field(d, "bos_token_id", None, type_=int)
    eos = hf_eos(d)
    for key, ids in (("bos_token_id", () if bos is None else (bos,)), ("eos_token_id", eos)):
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            warnings.warn(f"config.json {key} {', '.join(map(str, bad))} outside the vocabulary [0, {vocab_size}): "
                          f"ignored{' for stopping' if key == 'eos_token_id' else ''}", ConfigWarning, stacklevel=2)
    keep = tuple(t for t in eos if 0 <= t < vocab_size)
    return (bos if bos is not None and 0 <= bos < vocab_size else None), keep


def require_silu(d: dict) -> None:
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"hidden_act {act!r} is not supported (only 'silu')")


def common_fields(d: dict, L: int, raw: dict | None = None) -> dict:
    """The fields every GQA/MLA family reads the same way (`d` resolved, `raw` the config.json as written)."""
    vocab = hf_field(d, "vocab_size", type_=int)
    bos, eos = hf_special_tokens(d, vocab) if isinstance(vocab, int) and vocab > 0 else (None, ())
    return dict(
        vocab_size=vocab, hidden_size=hf_field(d, "hidden_size", type_=int),
        num_layers=L, num_heads=hf_field(d, "num_attention_heads", type_=int),
        rms_norm_eps=float(hf_field(d, "rms_norm_eps", 1e-6, type_=float)),
        max_position_embeddings=hf_field(d, "max_position_embeddings", type_=int),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        bos_token_id=bos, eos_token_id=eos, hf=dict(d if raw is None else raw),
    )
