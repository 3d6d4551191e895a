"""What the benchmarks and the tuner share: the GPU's measured bandwidth, how a kernel is timed, the header
and file of a result, and the MoE-layer shapes they both run (`megadecode bench`, `megadecode tune`)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import torch

from .hardware import HBM_READ_BPS  # noqa: F401  (re-exported: the benches' floor)
from .quant.fp8 import FP8Tensor, scale_shape
from .quant.mxfp4 import MXFP4Tensor
from .weights import ParamSpec, random_tensor


def graph_replay_ms(fn, calls: int = 1) -> float:
    """ms per call of `fn` (which makes `calls` calls), as the graph executors run kernels: fn runs once
    outside the capture (compiles, allocates), then once inside one CUDA graph, whose replay
    triton.testing.do_bench times (median, L2 flushed before each replay). GPU only."""
    from triton.testing import do_bench

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return float(do_bench(graph.replay)) / calls


def git_sha() -> str | None:
    """HEAD of the checkout, with "+modified" when tracked files differ from it (the GPU machine's copy carries
    the working tree over the .git of the session's start, so there its HEAD is not the code that ran);
    MEGADECODE_GIT_SHA overrides (copies are told the commit they were made from)."""
    if os.environ.get("MEGADECODE_GIT_SHA"):
        return os.environ["MEGADECODE_GIT_SHA"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    sha = out.stdout.strip()
    if out.returncode != 0 or not sha:
        return None
    try:  # tracked files that differ from HEAD: the sha does not name the code that ran (say so, never guess)
        st = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                            cwd=Path(__file__).resolve().parent, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return sha
    return sha + "+modified" if st.returncode == 0 and st.stdout.strip() else sha


def triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def default_out(preset: str, gpu_name: str) -> Path:
    return Path("bench/results") / f"{preset}-{gpu_name.lower().replace(' ', '-')}.json"


def environment(argv: list[str]) -> dict:
    """The header of a result file: GPU, software versions, commit, and the command that reproduces it."""
    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton_version(),
            "git_sha": git_sha(), "command": shlex.join(["megadecode", *argv])}


def write_result(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")


# Routed-expert shapes (D: the input of gate_up; I: the expert intermediate; A: experts per token;
# E: experts). k3: the LatentMoE experts (D = latent_size) of presets._K3; qwen3-30b-a3b: presets;
# deepseek-v3: its public config.json (hidden 7168, moe_intermediate 2048, 256 routed, top 8).
SHAPES = {
    "k3": {"D": 3584, "I": 3072, "A": 16, "E": 896, "act": "situ", "weights": "mxfp4"},
    "qwen3-30b-a3b": {"D": 2048, "I": 768, "A": 8, "E": 128, "act": "silu", "weights": "bf16"},
    "deepseek-v3": {"D": 7168, "I": 2048, "A": 8, "E": 256, "act": "silu", "weights": "bf16"},
}


def expert_weights(shape: dict, wfmt: str, gen: torch.Generator):
    """Random routed experts of a SHAPES entry on the GPU: (gate_up, down, bytes per expert). MXFP4: random
    bytes, e8m0 scales 118..123; bf16: normal with std 1/sqrt(fan-in); FP8: the random codes and block scales of
    weights.random_tensor (blocks of 128 x 128, dequantized std ~ 1/sqrt(fan-in))."""
    D, I, E = shape["D"], shape["I"], shape["E"]

    def one(out_dim, in_dim):
        if wfmt == "fp8":
            block = (128, 128)
            v, s = (random_tensor(ParamSpec("w", shp, init, block=block), gen, "cuda", torch.bfloat16)
                    for shp, init in (((E, out_dim, in_dim), "fp8"),
                                      (scale_shape((E, out_dim, in_dim), block), "fp8_scale")))
            return FP8Tensor(v, s, block)
        if wfmt == "mxfp4":
            return MXFP4Tensor(
                torch.randint(0, 256, (E, out_dim, in_dim // 2), device="cuda", dtype=torch.uint8, generator=gen),
                torch.randint(118, 124, (E, out_dim, in_dim // 32), device="cuda", dtype=torch.uint8, generator=gen))
        w = torch.empty(E, out_dim, in_dim, device="cuda", dtype=torch.bfloat16)
        return w.normal_(0.0, in_dim ** -0.5, generator=gen)

    gu, dn = one(2 * I, D), one(D, I)
    parts = {"mxfp4": lambda w: (w.packed, w.scales), "fp8": lambda w: (w.data, w.scales)}.get(wfmt, lambda w: (w,))
    per_expert = sum(t.numel() * t.element_size() // E for w in (gu, dn) for t in parts(w))
    return gu, dn, per_expert
