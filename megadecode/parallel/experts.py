"""Which routed experts a rank owns, and its view of the router's picks.

Rank r of `world` owns the contiguous block [r * E / world, (r + 1) * E / world) of every MoE layer's routed
experts (E = num_experts), stored as the local stack [E / world, ...] (weights.param_specs with a shard). world
must divide E: every rank then holds the same shapes, so every rank runs the same kernels with the same launch
parameters and holds the same bytes; an uneven split would work for the math but make one rank the slowest and
the largest, so it is refused with the divisors that work.

The router runs on every rank on the same (replicated) activations and picks the same global ids; `local_ids`
turns them into this rank's view: the local index of an owned expert, -1 for a pair another rank serves (the
routed-expert implementations skip -1 pairs: reference/moe.py, backends/fused/kernels/grouped_experts.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class ExpertShard:
    num_experts: int
    world: int
    rank: int

    def __post_init__(self):
        if self.world < 1 or not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} is outside the {self.world} ranks of expert parallelism")
        if self.num_experts % self.world:
            ok = ", ".join(map(str, divisors(self.num_experts)))
            raise ValueError(f"expert parallelism over {self.world} ranks needs the {self.num_experts} routed experts "
                             f"to split evenly: the number of ranks must divide num_experts ({ok})")

    @property
    def per_rank(self) -> int:
        return self.num_experts // self.world

    @property
    def lo(self) -> int:
        return self.rank * self.per_rank

    @property
    def hi(self) -> int:
        return self.lo + self.per_rank

    def owns(self, expert: int) -> bool:
        return self.lo <= expert < self.hi

    def local_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Global expert ids [T, A] -> this rank's local ids, -1 where another rank owns the expert (device ops,
        no host sync: capturable)."""
        if self.world == 1:
            return ids
        mine = (ids >= self.lo) & (ids < self.hi)
        return torch.where(mine, ids - self.lo, torch.full_like(ids, -1))
