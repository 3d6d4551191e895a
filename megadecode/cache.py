"""The KV cache: per layer, a [slots, max_len, ...] tensor per sequence slot, or fixed-size state for KDA.

GQA layers keep keys and values ([S, L, K, d] each); MLA layers keep the compressed latent and the
rope key ([S, L, kv_lora_rank + qk_rope_head_dim]), 576 values per token for DeepSeek-V3.
KDA layers (kimi_linear) keep per-sequence state whose size does not grow with the context:
  conv state      [S, 3*H*K, kernel-1]  the last kernel-1 inputs of the q/k/v short conv (model dtype);
  recurrent state [S, H, K, V]          the delta-rule memory per head, fp32 (as transformers keeps it:
                                        a decaying sum over the whole context is sensitive to rounding).
A prefill never reads a slot's KDA state: it starts each sequence from zero and overwrites the slot.
"""

from __future__ import annotations

import math

import torch

from .config import ModelConfig
from .plan import ATTN_KDA

# Which parts of a layer's cache keep fp32 whatever the model dtype, by the layer's attention kind (the plan's
# op kinds): KDA's recurrent state (part 1). Used here and by the validation harness when it casts cases.
FP32_PARTS: dict[str, tuple[int, ...]] = {ATTN_KDA: (1,)}


def part_dtype(attn_kind: str, part: int, dtype: torch.dtype) -> torch.dtype:
    """The dtype of part `part` of a layer's cache whose attention op kind is `attn_kind`, in a `dtype` model."""
    return torch.float32 if part in FP32_PARTS.get(attn_kind, ()) else dtype


def layer_shapes(cfg: ModelConfig, num_slots: int, max_len: int, dtype: torch.dtype
                 ) -> dict[str, tuple[tuple[tuple[int, ...], torch.dtype], ...]]:
    """Per layer `cache.{i}`, the (shape, dtype) of each of its cache tensors (what KVCache allocates)."""
    out = {}
    for i in range(cfg.num_layers):
        if cfg.is_kda(i):
            H, K = cfg.linear_num_heads, cfg.linear_head_dim
            out[f"cache.{i}"] = (((num_slots, 3 * H * K, cfg.conv_kernel - 1), dtype),
                                 ((num_slots, H, K, K), part_dtype(ATTN_KDA, 1, dtype)))
        elif cfg.is_mla:
            out[f"cache.{i}"] = (((num_slots, max_len, cfg.kv_lora_rank + cfg.qk_rope_head_dim), dtype),)
        else:
            shape = (num_slots, max_len, cfg.num_kv_heads, cfg.head_dim)
            out[f"cache.{i}"] = ((shape, dtype), (shape, dtype))
    return out


def cache_bytes(cfg: ModelConfig, num_slots: int, max_len: int, dtype: torch.dtype) -> int:
    """Bytes a KVCache of these dimensions allocates, computed without allocating it."""
    return sum(math.prod(shape) * dt.itemsize for parts in layer_shapes(cfg, num_slots, max_len, dtype).values()
               for shape, dt in parts)


class KVCache:
    def __init__(self, cfg: ModelConfig, num_slots: int, max_len: int, device, dtype: torch.dtype):
        if num_slots < 1 or max_len < 1:
            raise ValueError(f"cache needs >= 1 slot and >= 1 position, got {num_slots} x {max_len}")
        self.cfg, self.num_slots, self.max_len = cfg, num_slots, max_len
        self.layers: dict[str, tuple[torch.Tensor, ...]] = {
            name: tuple(torch.zeros(shape, device=device, dtype=dt) for shape, dt in parts)
            for name, parts in layer_shapes(cfg, num_slots, max_len, dtype).items()}
        # KDA layers: per-sequence state, not per-token
        self.state_layers: set[str] = {f"cache.{i}" for i in range(cfg.num_layers) if cfg.is_kda(i)}

    def __getitem__(self, name: str) -> tuple[torch.Tensor, ...]:
        return self.layers[name]

    def clear(self) -> None:
        """Zero every entry. Attention masks positions past a sequence's length with zero weights, and 0 * NaN is
        NaN: non-finite values a failed request left there would reach the next request of the slot."""
        for ts in self.layers.values():
            for t in ts:
                t.zero_()

    def clear_slot(self, slot: int, state_only: bool = False) -> None:
        """Zero one slot (`clear` says why a slot a failed request used must be); `state_only`: its KDA state
        only (the server's scratch slot, whose padding rows race on it, before each padded step)."""
        for name, ts in self.layers.items():
            if not state_only or name in self.state_layers:
                for t in ts:
                    t[slot].zero_()

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        """Slot dst holds what slot src holds for its first `length` positions (and its KDA state): a prompt
        prefilled once serves several sequences (a request's n choices)."""
        if src == dst or not (0 < length <= self.max_len):
            raise ValueError(f"copy_slot: src {src}, dst {dst}, length {length} (max {self.max_len})")
        for name, ts in self.layers.items():
            for t in ts:
                if name in self.state_layers:
                    t[dst].copy_(t[src])
                else:
                    t[dst, :length].copy_(t[src, :length])

    def save_state(self) -> list[torch.Tensor]:
        """A copy of every KDA layer's recurrent and conv state. A decode step advances that state (it is not
        idempotent, unlike a KV write): an executor that runs a step to warm up before capturing it saves the
        state first and puts it back after (`restore_state`), so the captured replay starts from the same state."""
        return [t.clone() for n in sorted(self.state_layers) for t in self.layers[n]]

    def restore_state(self, saved: list[torch.Tensor]) -> None:
        for t, s in zip((t for n in sorted(self.state_layers) for t in self.layers[n]), saved, strict=True):
            t.copy_(s)

    def bytes_per_token(self) -> int:
        """Cache bytes one token occupies (and one attending query reads), summed over the per-token layers."""
        return sum(t[0, 0].numel() * t.element_size() for n, ts in self.layers.items()
                   if n not in self.state_layers for t in ts)

    def state_bytes_per_sequence(self) -> int:
        """Fixed-size state bytes one sequence holds (and one decode step reads and writes): KDA layers."""
        return sum(t[0].numel() * t.element_size() for n in self.state_layers for t in self.layers[n])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for ts in self.layers.values() for t in ts)
