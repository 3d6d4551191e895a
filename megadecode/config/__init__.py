"""Model configuration: read an HF config.json into a validated ModelConfig.

    model.py      ModelConfig (and RopeConfig, ConfigError, ConfigWarning): the one dataclass the rest of
                  megadecode reads
    fields.py     typed readers of HF fields, shared by the parsers
    hf_class.py   config.json through transformers' own config class of the family (aliases, defaults)
    families/     one parser per family (qwen3_moe, deepseek_v3, kimi_linear, kimi_k3)
    registry.py   the families: model_type values, parser, validated executors (the one list of them)

The families transformers knows are read through its config class (Qwen3MoeConfig, DeepseekV3Config,
KimiLinearConfig): every spelling of a field it accepts is read (`num_local_experts` for `num_experts`,
`rope_parameters` for `rope_theta` + `rope_scaling`, ...) and a field left out takes its default, so the model
built is the one transformers would build; the fields that define the model's size have no default and are
required. kimi_k3 has no transformers class: its parser fills in the public K3 values. Special-token ids outside
the vocabulary are a ConfigWarning (and are ignored), not an error.
"""

from __future__ import annotations

import json
from pathlib import Path

from .model import (
    ConfigError,
    ConfigWarning,
    ModelConfig,
    RopeConfig,
    yarn_mscale,
)
from .registry import FAMILIES, MODEL_TYPES, PARSERS, REGISTRY  # PARSERS: HF `model_type` -> its family's parser

__all__ = ["FAMILIES", "MODEL_TYPES", "PARSERS", "REGISTRY", "ConfigError", "ConfigWarning", "ModelConfig", "RopeConfig",
           "config_from_hf", "load_config", "yarn_mscale"]


def config_from_hf(d: dict) -> ModelConfig:
    """Build and validate a ModelConfig from the dict of an HF config.json."""
    if not isinstance(d, dict):
        raise ConfigError("config.json must hold a JSON object")
    mt = d.get("model_type")
    if mt not in PARSERS:
        raise ConfigError(f"unsupported model_type {mt!r}; supported: {sorted(PARSERS)}")
    return PARSERS[mt](d)


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
