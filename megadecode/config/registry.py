"""The model families megadecode runs: the one list of them. A family is registered here once, with the HF
`model_type` values its checkpoints carry, its config.json parser (families/<name>.py) and the executors validated
for it; everything else (ModelConfig's check, the parsers by model_type, the executors' `supports`, the scopes of
the harness's variants) reads this table.

To add a family: a parser in families/<name>.py (`parse(dict) -> ModelConfig`), a row below, then its plan (plan.py builds it from ModelConfig's features,
not from the family's name), its weight names (weights.py), and each executor named in its row validated by the
harness (`megadecode validate`)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]  # HF config.json `model_type` values read as this family
    executors: tuple[str, ...]  # the executors validated for it (megadecode.backends.EXECUTORS' names)

    def parse(self, d: dict):
        """config.json's dict -> ModelConfig, by families/<name>.py's `parse` (imported on first use: the parsers
        build ModelConfig, whose check reads this table)."""
        return importlib.import_module(f"{__package__}.families.{self.name}").parse(d)


_ALL = ("torch", "graph", "fused")
REGISTRY: dict[str, Family] = {f.name: f for f in (
    Family("qwen3_moe", ("qwen3_moe",), _ALL + ("compiled", "pyvm", "mega")),
    # compiled: in bf16 its fused math flipped a near-tied routing decision against torch (backends/graph)
    Family("deepseek_v3", ("deepseek_v3", "kimi_k2"), _ALL + ("pyvm", "mega")),
    Family("kimi_linear", ("kimi_linear",), _ALL),  # KDA layers do not lower to the megakernel
    Family("kimi_k3", ("kimi_k3",), _ALL + ("pyvm", "mega")),
)}
FAMILIES = tuple(REGISTRY)
# every executor some family is validated for: the command line's --executor choices (no executor module imported)
EXECUTOR_NAMES = tuple(sorted({e for f in REGISTRY.values() for e in f.executors}))
PARSERS = {mt: f.parse for f in REGISTRY.values() for mt in f.model_types}  # HF `model_type` -> parser
MODEL_TYPES = {mt: f.name for f in REGISTRY.values() for mt in f.model_types}  # HF `model_type` -> family


def families_for(executor: str) -> tuple[str, ...]:
    """The families an executor is validated for."""
    return tuple(f.name for f in REGISTRY.values() if executor in f.executors)


def executor_refusal(executor: str, family: str) -> str | None:
    """None when `executor` is validated for `family`, else why not (one line)."""
    if family not in REGISTRY:
        return f"unknown family {family!r}; registered: {', '.join(FAMILIES)}"
    if executor in REGISTRY[family].executors:
        return None
    return (f"the {executor} executor is not validated for {family} (it is for {', '.join(families_for(executor))}); "
            f"executors for {family}: {', '.join(REGISTRY[family].executors)}")
