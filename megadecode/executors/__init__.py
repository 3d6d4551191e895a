"""Executors run a DecodePlan. `torch`: the reference, per op in plain PyTorch. `graph`: the same
per-op step without host syncs, captured in a CUDA graph (the strongest classic baseline)."""

from .torch_executor import TorchExecutor
from .graph_executor import GraphExecutor

EXECUTORS = {"torch": TorchExecutor, "graph": GraphExecutor}

__all__ = ["EXECUTORS", "TorchExecutor", "GraphExecutor"]
