"""Block Attention Residuals (kimi_k3's AttnRes), the definition megadecode implements (megadecode/k3.md).

Legend: N tokens, D hidden, S sources. Layers are grouped in blocks of `attn_res_block_size` consecutive
layers. The residual stream inside a block is a plain sum: `hidden` (the partial sum) starts as the token
embedding in block 0 and at zero in every later block, and each layer adds its output (attention + MLP) to it.
When a block ends its partial sum is frozen as that block's representation. Layer i's input is

    sources = [block_0, ..., block_{b-1}] + ([partial] if the current block already has a layer output)
    alpha   = softmax_s(query_i . rmsnorm(sources[s]) * norm_i.weight)       fp32, no 1/sqrt(D)
    x_i     = sum_s alpha_s sources[s]                                        [N, D]

and the final norm reads the same attention with the model-level query (`model.attn_res.*`) over every
block. With one block (block size >= num_layers) there is one source, alpha = 1 and x_i = embedding + the
outputs of layers < i: the plain pre-norm residual stream (tests/test_k3.py checks that degenerate case).
"""

from __future__ import annotations

import torch


def attn_res(sources: torch.Tensor, query: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """sources [S, N, D] -> [N, D] in sources' dtype; scores, softmax and the weighted sum in fp32."""
    v = sources.float()
    keys = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
    alpha = torch.softmax(torch.einsum("snd,d->sn", keys, query.float()), dim=0)  # over sources
    return torch.einsum("sn,snd->nd", alpha, v).to(sources.dtype)
