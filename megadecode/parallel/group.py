"""The process group of expert parallelism: one process per rank, started by torchrun (or by
parallel/launch.py, which sets the same variables), NCCL between GPUs and gloo on the CPU.

torchrun's environment: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT. The number of ranks must equal
`--ep`; on CUDA rank r runs on GPU LOCAL_RANK. Every collective has a timeout (`timeout_s`): a rank that waits for
a peer that failed or hangs raises after it instead of waiting forever (gloo raises at once when a peer's
connection closes; NCCL's watchdog aborts the communicator at the timeout). `control` is a second group (gloo,
host objects) for what rank 0 tells the others: the failures found while loading (`agree`) and, when serving, the
scheduler's decisions; it waits up to CONTROL_TIMEOUT_S, since an idle server sends nothing for long stretches.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
CONTROL_TIMEOUT_S = 7 * 24 * 3600.0


class RankFailed(RuntimeError):
    """A rank failed where all ranks compare notes (`agree`): every rank raises it with the same message, so rank 0
    alone reports it."""


@dataclass
class EPGroup:
    rank: int
    world: int
    local_rank: int
    backend: str
    device: torch.device
    group: object  # the process group of the collectives (the default group)
    control: object  # gloo, host objects
    timeout_s: float

    def destroy(self, wait_s: float | None = None) -> bool:
        """Tear the groups down; False when NCCL's teardown did not finish within `wait_s` (default
        DESTROY_TIMEOUT_S), which is then left to a thread and `stuck_teardown()` says so.

        Call it after the engine is gone: a live CUDA graph that captured a collective keeps ncclCommDestroy
        waiting forever (pytorch/pytorch#115388; seen with `generate --ep 2` on two H200s).
        """
        global _stuck
        if not dist.is_initialized():
            return True
        gc.collect()  # graphs held only by reference cycles
        if self.device.type == "cuda":
            try:
                torch.cuda.synchronize(self.device)
            except RuntimeError:  # a failed kernel's sticky error: the exception on its way out says it, not this
                pass
        done = threading.Event()

        def teardown():
            dist.destroy_process_group()
            done.set()

        threading.Thread(target=teardown, name="megadecode-ep-teardown", daemon=True).start()
        wait_s = DESTROY_TIMEOUT_S if wait_s is None else wait_s
        if done.wait(wait_s):
            return True
        _stuck = True
        print(f"megadecode: warning: rank {self.rank}: the process group's teardown did not finish in {wait_s:.0f} s "
              "(NCCL); the process exits without it", file=sys.stderr, flush=True)
        return False


_stuck = False
DESTROY_TIMEOUT_S = 30.0


def stuck_teardown() -> bool:
    """Whether a teardown (EPGroup.destroy) did not finish: the process must then end with os._exit, since the
    interpreter's exit would wait for the communicator again."""
    return _stuck


def torchrun_env() -> dict[str, str] | None:
    """torchrun's variables when this process was started by it (or by launch.spawn), else None."""
    if not all(v in os.environ for v in TORCHRUN_VARS):
        return None
    return {v: os.environ[v] for v in TORCHRUN_VARS}


def rank() -> int:
    """This process's rank (0 outside torchrun)."""
    return int(os.environ.get("RANK", "0")) if torchrun_env() else 0


def check_world(ep: int) -> int:
    """The number of ranks, checked against `ep` (--ep): torchrun's WORLD_SIZE must equal it. ValueError naming
    both when they differ."""
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise ValueError(f"--ep must be a positive integer, got {ep!r}")
    env = torchrun_env()
    world = int(env["WORLD_SIZE"]) if env else 1
    if env and world != ep:
        raise ValueError(f"torchrun started {world} processes (WORLD_SIZE) but --ep is {ep}: one process per "
                         f"rank, so pass --ep {world} or start {ep} (--nproc-per-node x --nnodes)")
    if not env and ep > 1:
        raise ValueError(f"--ep {ep} needs {ep} processes: run under torchrun (torchrun --nproc-per-node {ep} -m "
                         f"megadecode ...) or let the command start them (it does when not under torchrun)")
    return world


def init(ep: int, device: str, timeout_s: float) -> EPGroup | None:
    """Join the process group torchrun describes; None for one rank. `device` "cuda": NCCL, rank on GPU
    LOCAL_RANK; "cpu": gloo."""
    world = check_world(ep)
    if world == 1:
        return None
    if not timeout_s > 0:
        raise ValueError(f"--dist-timeout must be > 0 seconds, got {timeout_s}")
    env = torchrun_env()
    r, local = int(env["RANK"]), int(env["LOCAL_RANK"])
    timeout = timedelta(seconds=timeout_s)
    if str(device).startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA GPU is available")
        per_node = max(int(os.environ.get("LOCAL_WORLD_SIZE", local + 1)), local + 1)
        if per_node > torch.cuda.device_count():  # the same on every rank of the node: rank 0 reports it
            raise ValueError(f"{per_node} ranks per node need {per_node} GPUs (one each, GPU LOCAL_RANK), but this "
                             f"node has {torch.cuda.device_count()}: start at most that many processes per node")
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", rank=r, world_size=world, timeout=timeout, device_id=dev)
        backend = "nccl"
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo", rank=r, world_size=world, timeout=timeout)
        backend = "gloo"
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=CONTROL_TIMEOUT_S))
    return EPGroup(r, world, local, backend, dev, dist.group.WORLD, control, timeout_s)


def all_gather_rows(out: torch.Tensor, x: torch.Tensor, group) -> None:
    """out [W * T, N] = the ranks' x [T, N] in rank order (all_gather_into_tensor, renamed in newer torch): the
    combine's and the logits' one collective."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, x, group=group)


def agree(ep: EPGroup | None, fn, *args, **kw):
    """fn(*args, **kw) on every rank; if it raised on any rank, every rank raises RankFailed with the first failing
    rank's message (prefixed with its rank when that is not rank 0), so no rank goes on to wait for one that has
    stopped. For one rank, just the call."""
    if ep is None:
        return fn(*args, **kw)
    try:
        result, err = fn(*args, **kw), None
    except Exception as e:  # noqa: BLE001 - reported to every rank below
        result, err = None, str(e) or type(e).__name__
    errs: list = [None] * ep.world
    dist.all_gather_object(errs, err, group=ep.control)
    bad = next(((r, e) for r, e in enumerate(errs) if e is not None), None)
    if bad is not None:
        r, e = bad
        raise RankFailed(e if r == 0 else f"rank {r}: {e}")
    return result
