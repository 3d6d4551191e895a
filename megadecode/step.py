"""What one executor call computes: a batch of new tokens and where each one lives in the cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Step:
    """N new tokens. Each token belongs to the sequence in cache slot `slots[n]` at `positions[n]`.

    Decode steps have one token per sequence (`segments is None`) and need no host metadata beyond
    `kv_len`, so they can be captured in a CUDA graph. Prefill steps list their sequences on the host:
    `segments[i] = (first_token, end_token, slot)`.
    """

    tokens: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64
    slots: torch.Tensor  # [N] int64
    logit_rows: torch.Tensor  # [B] int64: rows of the N tokens whose next-token logits are wanted
    kv_len: int  # cache positions [0, kv_len) may be attended to (>= max(positions) + 1)
    segments: list[tuple[int, int, int]] | None = None
    # Decode only: slots are 0..N-1 in order, so attention can read the cache as a view, not a gather.
    contiguous_slots: bool = False
    # Decode only: rows may be consecutive positions of one sequence (a speculative verify step), each attending to
    # the entries its sequence's earlier rows write in the same step (the megakernel then runs a program that writes
    # every row's cache entry a phase before any row reads the cache; mega/lower.py `causal_rows`)
    causal_rows: bool = False
    # Prefill only: each segment's first position (None: every segment a new sequence from position 0). A segment
    # that starts past 0 continues its slot's sequence (speculative verify steps): KDA layers start from the slot's
    # conv and recurrent state instead of zeros.
    seg_first: list[int] | None = None
    # Prefill only: when a list, each KDA layer appends, per segment, the state after each of its tokens
    # (reference/kda.py, `KdaTrace`), so a verify step's rejected drafts can be taken back (speculative.py).
    state_trace: list | None = None
    # Prefill only: when a list, the executor appends the last layer's output of every token [N, D] (the final
    # norm's input; the MTP drafter's input, speculative.MtpDrafter).
    last_hidden: list | None = None

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[0]
