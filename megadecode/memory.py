"""What a model needs in memory against what its device has, checked before any weight or cache is built (a
model that does not fit then fails with one line naming the sizes, not in the allocator half way through)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .cache import cache_bytes
from .config import ModelConfig
from .weights import weight_bytes

GB = 1e9


class InsufficientMemory(ValueError):
    """The weights and cache asked for do not fit in the memory the device has available."""


def _read_int(path: str) -> int | None:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup v2 writes "max" for no limit


def host_available_bytes() -> int:
    """Memory a new allocation can take on this host: /proc/meminfo's MemAvailable (os.sysconf's free pages
    elsewhere), capped by the cgroup v2 limit of this process's container when there is one."""
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
                break
    except OSError:
        pass
    if avail is None:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    limit, used = _read_int("/sys/fs/cgroup/memory.max"), _read_int("/sys/fs/cgroup/memory.current")
    if limit is not None and used is not None:
        avail = min(avail, max(limit - used, 0))
    return avail


def available_bytes(device) -> int:
    """Free memory on `device`: the GPU's free bytes (torch.cuda.mem_get_info), or the host's."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return host_available_bytes()


def check_fits(what: str, cfg: ModelConfig, device, dtype: torch.dtype, max_batch: int, max_seq_len: int,
               shard=None, extra: tuple[int, str] | None = None) -> None:
    """Raise InsufficientMemory naming `what` (the model as the user gave it) when its weights in `dtype` plus a
    cache of `max_batch` sequences x `max_seq_len` positions exceed the device's available memory. A lower bound:
    activations and (checkpoints) one tensor in flight come on top. `shard` (expert parallelism): the rank's
    weights, its own experts only. `extra`: (bytes, what for) the engine's build needs on top for a while."""
    weights = weight_bytes(cfg, dtype.itemsize, shard)["total"]
    cache = cache_bytes(cfg, max_batch, max_seq_len, dtype)
    more, why = extra or (0, "")
    avail = available_bytes(device)
    if weights + cache + more > avail:
        seqs = f"{max_batch} sequence{'s' if max_batch > 1 else ''}"
        whose = "" if shard is None or shard.world == 1 else f" (rank {shard.rank} of {shard.world}: its experts)"
        plus = f" + {more / GB:.2f} GB {why}" if more else ""
        raise InsufficientMemory(
            f"{what}{whose} needs {(weights + cache + more) / GB:.2f} GB on {torch.device(device)} ({weights / GB:.2f} "
            f"GB of {str(dtype).removeprefix('torch.')} weights + {cache / GB:.2f} GB of cache for {seqs} x "
            f"{max_seq_len} positions{plus}), but only {avail / GB:.2f} GB is available there")
