"""Executors run a DecodePlan. `torch`: the reference, per op in plain PyTorch. `graph`: the same
per-op step without host syncs, captured in a CUDA graph. `compiled`: that step through torch.compile,
then captured (the gpt-fast recipe). `fused`: the graph step with ops replaced by the harness's
registered Triton variants, captured."""

from .torch_executor import TorchExecutor
from .graph_executor import CompiledGraphExecutor, GraphExecutor
from .fused_executor import FusedExecutor

EXECUTORS = {"torch": TorchExecutor, "graph": GraphExecutor, "compiled": CompiledGraphExecutor,
             "fused": FusedExecutor}

__all__ = ["EXECUTORS", "CompiledGraphExecutor", "FusedExecutor", "GraphExecutor", "TorchExecutor"]
