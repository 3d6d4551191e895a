"""The combine of a MoE layer under expert parallelism, and the rank's view of a layer's experts.

Every rank holds the same tokens (the trunk is replicated) and computes the partial sum over its own experts,
fp32 [T, N] (N: the hidden size, or K3's latent size: the routed sum is combined before the latent norm). The
layer's output is the sum of the ranks' partials, needed on every rank.

Deterministic by construction: each rank receives the partials it needs and adds them itself, in rank order
(((p_0 + p_1) + p_2) + ..., fp32), so the result is bitwise the same on every rank and from run to run for a given
number of ranks, whichever mode moved the bytes; no collective's internal reduction order is relied on (NCCL's
all-reduce and reduce-scatter sum in an order set by the algorithm and protocol it picks, and gloo's differs
again). Being the same on every rank matters beyond reproducibility: each rank routes the next layer on its own
copy of the activations, and ranks that disagreed by one ulp could pick different experts. Both modes add the
same values in the same order, so they agree bit for bit (tests/test_ep.py, the `modes` scenario).

Modes (W ranks; bytes each rank receives for T tokens of N fp32 values):
  all-gather      one all-gather of the partials [W, T, N]; each rank adds the W rows.
                  (W - 1) T N 4 bytes, one collective.
  reduce-scatter  a reduce-scatter, then an all-gather of its sums: rank r sums block r of the rows (ceil(T / W)
                  rows) and the blocks are gathered. The reduce-scatter is an all-to-all of row blocks (rank r
                  receives every rank's partial of block r) summed here in rank order, not NCCL's reduce-scatter,
                  whose order is its own. 2 (W - 1) ceil(T / W) N 4 bytes, two collectives.
With every rank holding every token, a MoE layer needs no dispatch (each rank already has the activations its
experts read): its communication is this combine. In a scheme where each token lives on one rank (attention data
parallel), the same two shapes are the issue's two options, the all-gather of tokens + reduce-scatter of results
against an all-to-all of tokens to their experts' ranks and back. At decode batch sizes a collective's latency
dominates its bytes, which favours one all-gather; with more tokens or ranks the reduce-scatter moves fewer bytes.
Which mode runs at which batch is data measured on the GPU (MODES_DIR, written by `bench/ep_bench.py
--write-modes`): {"device", "world": {W: {"N=<n>": {batch: mode}}}, "measured"}; the entry of the smallest measured
batch >= T, else the largest; all-gather where there is no file.

`comm = False` (measurement only: bench's communication-off run) skips the collectives: each rank keeps its own
partial, so the results are wrong but the step does the same compute.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import torch
import torch.distributed as dist

from .experts import ExpertShard
from .group import all_gather_rows
from .vocab import VocabShard, gather_logits

ALL_GATHER, REDUCE_SCATTER = "all-gather", "reduce-scatter"
MODES = (ALL_GATHER, REDUCE_SCATTER)
MODES_DIR = Path(__file__).resolve().parent / "configs"


def sum_in_rank_order(parts: torch.Tensor) -> torch.Tensor:
    """parts [W, ...] -> parts[0] + parts[1] + ... + parts[W-1], added in that order (fp32)."""
    acc = parts[0].clone()
    for r in range(1, parts.shape[0]):
        acc += parts[r]
    return acc


def gather_combine(x: torch.Tensor, world: int, group) -> torch.Tensor:
    """The all-gather mode: every rank's partial to every rank, summed here in rank order."""
    T, N = x.shape
    out = torch.empty((world * T, N), dtype=x.dtype, device=x.device)
    all_gather_rows(out, x, group)
    return sum_in_rank_order(out.view(world, T, N))


def scatter_combine(x: torch.Tensor, world: int, group) -> torch.Tensor:
    """The reduce-scatter mode: rank r sums rows block r of every rank's partial (all-to-all), in rank order; the
    summed blocks are then all-gathered."""
    T, N = x.shape
    rows = -(-T // world)  # each rank sums one block of rows
    send = torch.zeros((world * rows, N), dtype=x.dtype, device=x.device)
    send[:T] = x
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv block s: rank s's partial of this rank's rows
    mine = sum_in_rank_order(recv.view(world, rows, N))
    out = torch.empty_like(send)
    all_gather_rows(out, mine, group)
    return out[:T]


@lru_cache(maxsize=None)
def _modes_file(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"malformed combine-mode file {path}: {e}") from None
    for w, by_n in (data.get("world") or {}).items():
        for n, by_batch in by_n.items():
            bad = [m for m in by_batch.values() if m not in MODES]
            if bad or not all(b.isdigit() for b in by_batch):
                raise ValueError(f"malformed combine-mode file {path}: world {w}, {n}: batches must map to one "
                                 f"of {MODES}")
    return data


def modes_path(device_name: str) -> Path:
    return MODES_DIR / f"{device_name.strip().lower().replace(' ', '-')}.json"


def measured_mode(device_name: str | None, world: int, width: int, batch: int) -> str | None:
    """The measured faster mode for (GPU, world size, width, batch), or None without a measurement."""
    if device_name is None:
        return None
    data = _modes_file(modes_path(device_name))
    by_batch = ((data or {}).get("world") or {}).get(str(world), {}).get(f"N={width}")
    if not by_batch:
        return None
    sizes = sorted(int(b) for b in by_batch)
    return by_batch[str(next((b for b in sizes if b >= batch), sizes[-1]))]


class ExpertParallel:
    """What a MoE op needs under expert parallelism: which experts are local (`shard`) and the combine of the ranks'
    partial sums. `mode`: ALL_GATHER or REDUCE_SCATTER for every batch, None to choose per batch (measured_mode)."""

    def __init__(self, shard: ExpertShard, group=None, device_name: str | None = None, mode: str | None = None):
        if mode is not None and mode not in MODES:
            raise ValueError(f"combine mode must be one of {MODES}, got {mode!r}")
        self.shard, self.group, self.device_name, self.mode = shard, group, device_name, mode
        self.comm = True

    @property
    def world(self) -> int:
        return self.shard.world

    @property
    def rank(self) -> int:
        return self.shard.rank

    def local_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return self.shard.local_ids(ids)

    def mode_for(self, batch: int, width: int) -> str:
        return self.mode or measured_mode(self.device_name, self.world, width, batch) or ALL_GATHER

    def combine(self, partial: torch.Tensor) -> torch.Tensor:
        """partial [T, N] fp32 (this rank's experts) -> the sum over every rank's partial, in rank order."""
        if self.world == 1 or not self.comm:
            return partial
        x = partial.float().contiguous()
        fn = gather_combine if self.mode_for(x.shape[0], x.shape[1]) == ALL_GATHER else scatter_combine
        return fn(x, self.world, self.group)

    def gather_logits(self, local: torch.Tensor, vocab: int) -> torch.Tensor:
        """This rank's logits [T, rows held] of a vocabulary of `vocab` -> the whole [T, V] on every rank
        (parallel/vocab.py)."""
        return gather_logits(local, VocabShard(vocab, self.world, self.rank), self.group, self.comm)

    def check_same(self, t: torch.Tensor, what: str) -> None:
        """Raise RuntimeError unless `t` (e.g. the generated token ids) is the same on every rank: ranks run the same
        steps on the same activations, so they must agree (a check, after the run, that they stayed in step)."""
        if self.world == 1:
            return
        x = t.contiguous()
        out = torch.empty((self.world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        all_gather_rows(out, x, self.group)
        parts = out.view(self.world, *x.shape)
        bad = [r for r in range(self.world) if not torch.equal(parts[r], parts[0])]
        if bad:
            raise RuntimeError(f"expert-parallel ranks diverged: {what} on rank {bad[0]} differs from rank 0's "
                               f"(the ranks must be identical devices running the same software)")
