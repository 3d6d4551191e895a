"""`--executor auto`: the fastest executor validated for the model's family on this GPU, per batch size, from a
committed table of measured step times (picks/<gpu>.json, made by bench/auto_picks.py from bench/results).

The pick is the table's fastest executor for the nearest measured batch at or below the asked one (the smallest
above it when none is below) that can run here: validated for the family (config/registry.py), and its needs met
(Triton for fused; CUTLASS's DSL and bf16 weights for mega). A family the table has not measured takes `fused`,
validated for every family. On the CPU, `torch`, the reference: every other executor needs a CUDA GPU.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import torch

from ..config import ModelConfig

PICKS = Path(__file__).with_name("picks")
TABLES = {"NVIDIA H200": "nvidia-h200.json"}  # torch.cuda.get_device_name() -> table


def _needs(name: str, cfg: ModelConfig, dtype: torch.dtype) -> str | None:
    """Why executor `name` cannot run here, or None."""
    from . import EXECUTORS

    why = EXECUTORS[name].supports(cfg)  # the registry's word, and the executor's own conditions
    if why:
        return why
    if name in ("fused", "compiled") and importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    if name == "mega":
        if importlib.util.find_spec("cutlass") is None:
            return "nvidia-cutlass-dsl is not installed (the `cute` extra)"
        if dtype != torch.bfloat16:
            return "it runs bf16 weights"
    return None


def table_for(gpu: str) -> dict | None:
    name = TABLES.get(gpu)
    return json.loads((PICKS / name).read_text()) if name else None


def choose(cfg: ModelConfig, device, dtype: torch.dtype, batch: int) -> tuple[str, str]:
    """(executor, one line saying why)."""
    device = torch.device(device)
    if device.type != "cuda":
        return "torch", "auto -> torch: on the CPU the reference executor (the others need a CUDA GPU)"
    gpu = torch.cuda.get_device_name(device)
    t = table_for(gpu)
    fam = (t or {}).get("families", {}).get(cfg.family)
    if fam is None:
        why = _needs("fused", cfg, dtype)
        if why is None:
            where = f"no measured table for {cfg.family} on {gpu}" if t else f"no measured table for {gpu}"
            return "fused", f"auto -> fused: {where}; fused is validated for every family"
        return "graph", f"auto -> graph: no measured table for {cfg.family} on {gpu}, and fused cannot run ({why})"
    batches = sorted(int(b) for b in fam["batches"])
    at = max((b for b in batches if b <= batch), default=batches[0])
    skipped = []
    for c in fam["batches"][str(at)]:
        why = _needs(c["executor"], cfg, dtype)
        if why is None:
            others = ", ".join(f"{o['executor']} {o['ms']:.2f}" for o in fam["batches"][str(at)] if o is not c)
            skip = "".join(f"; {n} skipped: {w}" for n, w in skipped)
            return c["executor"], (f"auto -> {c['executor']}: fastest for {cfg.family} at batch {at} on {gpu} "
                                   f"({c['ms']:.2f} ms a step against {others}; {c['from']}; "
                                   f"bench/auto_picks.py{skip})")
        skipped.append((c["executor"], why))
    return "torch", "auto -> torch: no measured executor can run here (" + "; ".join(f"{n}: {w}" for n, w in skipped) + ")"


def resolve_executor(args, cfg, batch: int, say: bool) -> None:
    """`--executor auto` replaced by its pick for `batch` sequences, the reason printed once (on a GPU; on the CPU
the pick is always `torch`)."""
    if args.executor != "auto":
        return
    args.executor, why = choose(cfg, args.device, getattr(torch, args.dtype), batch)  # float32 | bfloat16
    if say and args.device != "cpu":  # on the CPU it is always the reference: nothing to name
        print(f"megadecode: {why}", file=sys.stderr, flush=True)
