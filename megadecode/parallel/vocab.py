"""The vocab-parallel lm_head of expert parallelism: rank r of `world` holds rows [r P, r P + P) of the lm_head
(P = ceil(V / world), V the vocabulary), computes that slice of the logits, and an all-gather makes the whole
[T, V] logits on every rank, so sampling, logprobs and serving see the same tensor as with one process.

Why: every rank streams the replicated trunk each step, and the lm_head is a large part of it (k3-mini: 2.35 of the
7.6 GB a step reads; 163840 x 7168 bf16). Split by rows, each rank reads 1 / world of it, for one all-gather of
T x P fp32 logits per step (docs/ep-model.md). Each logit is one row's dot product on one rank, and the gather
moves bytes without arithmetic, so the logits are bitwise the same on every rank.

When world does not divide V, the last rank's slice is shorter: its weight is padded with zero rows to P, so every
rank holds the same shape and the gather is one collective of equal parts; the padded logits are dropped. A tied
lm_head (tie_word_embeddings) stays whole: the embedding needs every row of the table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import group as group_


@dataclass(frozen=True)
class VocabShard:
    vocab: int
    world: int
    rank: int

    def __post_init__(self):
        if self.vocab < 1 or self.world < 1 or not 0 <= self.rank < self.world:
            raise ValueError(f"no vocab shard for rank {self.rank} of {self.world} over {self.vocab} tokens")
        if self.world > self.vocab:
            raise ValueError(f"{self.world} ranks cannot split a vocabulary of {self.vocab} tokens by rows")

    @property
    def per_rank(self) -> int:
        """Rows each rank holds (the last rank's padded with zero rows past the vocabulary)."""
        return -(-self.vocab // self.world)

    @property
    def lo(self) -> int:
        return min(self.rank * self.per_rank, self.vocab)

    @property
    def hi(self) -> int:
        return min(self.lo + self.per_rank, self.vocab)


def split_lm_head(cfg, world: int) -> bool:
    """Whether expert parallelism over `world` ranks splits the lm_head by rows: more than one rank and an lm_head
    of its own (a tied one is the embedding table, which every rank needs whole)."""
    return world > 1 and not cfg.tie_word_embeddings


def _padded(rows: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """A new [per_rank, D] tensor: `rows`, then zero rows."""
    out = torch.zeros((shard.per_rank, *rows.shape[1:]), dtype=rows.dtype, device=rows.device)
    out[:rows.shape[0]] = rows
    return out


def shard_rows(full: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """Rows [lo, hi) of the whole lm_head [V, D], padded with zero rows to [per_rank, D] (a copy: the whole tensor
    is not kept alive by a view)."""
    if full.shape[0] != shard.vocab:
        raise ValueError(f"lm_head has {full.shape[0]} rows, the vocabulary {shard.vocab}")
    return _padded(full[shard.lo:shard.hi], shard)


def pad_rows(part: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """A rank's rows as read from a checkpoint ([hi - lo, D]), padded with zero rows to [per_rank, D]."""
    return part if part.shape[0] == shard.per_rank else _padded(part, shard)


def gather_logits(local: torch.Tensor, shard: VocabShard, group, comm: bool = True) -> torch.Tensor:
    """This rank's logits [T, per_rank] -> the whole [T, V] on every rank (one all-gather, fp32). `comm` False
    (bench's communication-off run): no collective, this rank's slice in place and zeros elsewhere (same shapes,
    wrong values)."""
    T, P = local.shape
    x = local.float().contiguous()
    if not comm:
        out = torch.zeros((T, shard.world * P), dtype=x.dtype, device=x.device)
        out[:, shard.rank * P:(shard.rank + 1) * P] = x
        return out[:, :shard.vocab]
    parts = torch.empty((shard.world * T, P), dtype=x.dtype, device=x.device)
    group_.all_gather_rows(parts, x, group)
    return parts.view(shard.world, T, P).permute(1, 0, 2).reshape(T, shard.world * P)[:, :shard.vocab]
