"""Executors run a DecodePlan. `torch`: the reference, per op in plain PyTorch. `graph`: the same
per-op step without host syncs, captured in a CUDA graph. `compiled`: that step through torch.compile,
then captured (the gpt-fast recipe)."""

from .torch_executor import TorchExecutor
from .graph_executor import CompiledGraphExecutor, GraphExecutor

EXECUTORS = {"torch": TorchExecutor, "graph": GraphExecutor, "compiled": CompiledGraphExecutor}

__all__ = ["EXECUTORS", "CompiledGraphExecutor", "GraphExecutor", "TorchExecutor"]
