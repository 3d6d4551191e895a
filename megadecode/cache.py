"""The KV cache: per layer, a [slots, max_len, ...] tensor per sequence slot.

GQA layers keep keys and values ([S, L, K, d] each); MLA layers keep the compressed latent and the
rope key ([S, L, kv_lora_rank + qk_rope_head_dim]), 576 values per token for DeepSeek-V3.
"""

from __future__ import annotations

import torch

from .config import ModelConfig


class KVCache:
    def __init__(self, cfg: ModelConfig, num_slots: int, max_len: int, device, dtype: torch.dtype):
        if num_slots < 1 or max_len < 1:
            raise ValueError(f"cache needs >= 1 slot and >= 1 position, got {num_slots} x {max_len}")
        self.cfg, self.num_slots, self.max_len = cfg, num_slots, max_len
        self.layers: dict[str, tuple[torch.Tensor, ...]] = {}
        for i in range(cfg.num_layers):
            if cfg.is_mla:
                shape = (num_slots, max_len, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
                self.layers[f"cache.{i}"] = (torch.zeros(shape, device=device, dtype=dtype),)
            else:
                shape = (num_slots, max_len, cfg.num_kv_heads, cfg.head_dim)
                self.layers[f"cache.{i}"] = (torch.zeros(shape, device=device, dtype=dtype),
                                             torch.zeros(shape, device=device, dtype=dtype))

    def __getitem__(self, name: str) -> tuple[torch.Tensor, ...]:
        return self.layers[name]

    def bytes_per_token(self) -> int:
        """Cache bytes one token occupies (and one attending query reads), summed over layers."""
        return sum(t[0, 0].numel() * t.element_size() for ts in self.layers.values() for t in ts)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for ts in self.layers.values() for t in ts)
