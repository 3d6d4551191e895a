"""Executors run a DecodePlan. `torch`: the reference, per op in plain PyTorch. `graph`: the same
per-op step without host syncs, captured in a CUDA graph. `compiled`: that step through torch.compile,
then captured (the gpt-fast recipe). `fused`: the graph step with ops replaced by the harness's
registered Triton variants, captured. `pyvm`: the megakernel's instruction stream interpreted with torch (its
golden model). `mega`: one persistent CuTe DSL kernel per decode step."""

from .fused.executor import FusedExecutor
from .graph.executor import CompiledGraphExecutor, GraphExecutor
from .mega.executor import MegaExecutor
from .mega.pyvm_executor import PyVMExecutor
from .torch.executor import TorchExecutor

EXECUTORS = {"torch": TorchExecutor, "graph": GraphExecutor, "compiled": CompiledGraphExecutor,
             "fused": FusedExecutor, "pyvm": PyVMExecutor, "mega": MegaExecutor}

__all__ = ["EXECUTORS", "CompiledGraphExecutor", "FusedExecutor", "GraphExecutor", "MegaExecutor", "PyVMExecutor",
           "TorchExecutor"]
