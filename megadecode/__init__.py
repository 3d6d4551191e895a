"""megadecode: a decode engine for extremely sparse Mixture-of-Experts models.

The package reads bottom up: config, plan, the op contract, kernels, executors, engine, then the command line
and the validation harness on top (docs/package-layout.md). The names below are imported on first use, so
that importing one submodule (a kernel, the config) does not import the engine.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {"ConfigError": "config", "ModelConfig": "config", "config_from_hf": "config", "load_config": "config",
            "Engine": "engine", "GenerationResult": "engine", "RequestError": "engine", "SamplingParams": "sampling"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
