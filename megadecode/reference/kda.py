"""Kimi Delta Attention (KDA, kimi_linear's linear-attention layers), as transformers' KimiLinearDeltaAttention
computes it; the recurrence runs token by token (the readable form of the chunked kernels).

Legend: N new tokens, D hidden, H heads, K key dim = V value dim (`linear_head_dim`), C = 3*H*K conv
channels (q, k, v), W conv width (`short_conv_kernel_size`). S [H, K, V] is a sequence's recurrent state.

Per token of a sequence:
  qkv  = SiLU(causal depthwise conv_W([q_proj x, k_proj x, v_proj x]))   over this and the W-1 previous tokens
  q, k = l2norm(q), l2norm(k) per head (fp32, x / sqrt(sum x^2 + 1e-6)); q *= K^-1/2
  g    = -exp(A_log[h]) * softplus(f_b(f_a x) + dt_bias)        [H, K]  log of the per-channel decay (fp32)
  beta = sigmoid(b_proj x)                                      [H]
  S    = exp(g)[..., None] * S                                  each key channel decays at its own rate
  S    = S + k (x) beta * (v - k^T S)                           delta rule: what k reads is moved toward v
  o    = q^T S                                                  [H, V]
  y    = o_proj(rmsnorm_V(o) * o_norm.weight * sigmoid(g_b(g_a x)))   gated RMSNorm per head, in fp32
The conv and the recurrence start from zero state at a sequence's first token; a prefill segment that continues
its sequence (`Step.seg_first` past 0: a speculative verify step) starts from the slot's state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from ..step import Step


@dataclass
class KdaTrace:
    """One KDA layer's states after each token of one prefill segment (`Step.state_trace`): conv [n, C, W-1] (the
    conv's last W-1 inputs), rec [n, H, K, V] fp32, for the segment's slot of the layer's state tensors. `rewind`
    puts the state after the segment's first `kept` tokens back into the slot."""
    conv_state: torch.Tensor
    rec_state: torch.Tensor
    slot: int
    segment: int
    conv: torch.Tensor
    rec: torch.Tensor

    def rewind(self, kept: int) -> None:
        n = self.rec.shape[0]
        if not 1 <= kept <= n:
            raise ValueError(f"a segment of {n} tokens keeps 1..{n} of them, not {kept}")
        self.conv_state[self.slot] = self.conv[kept - 1]
        self.rec_state[self.slot] = self.rec[kept - 1]


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def delta_rule_step(q, k, v, g, beta, S):
    """One token for B sequences: q, k, g [B, H, K], v [B, H, V], beta [B, H], S [B, H, K, V] (fp32).
    Returns (o [B, H, V], new S)."""
    S = S * g.exp()[..., None]
    read = torch.einsum("bhk,bhkv->bhv", k, S)
    S = S + k[..., None] * ((v - read) * beta[..., None])[..., None, :]
    return torch.einsum("bhk,bhkv->bhv", q, S), S


def _conv_silu(windows: torch.Tensor, conv_w: torch.Tensor) -> torch.Tensor:
    """windows [..., C, W] (oldest first), conv_w [C, W] -> SiLU(sum_w windows * conv_w) [..., C], fp32."""
    return F.silu((windows.float() * conv_w.float()).sum(-1))


def decode_recurrence(q, k, v, g, beta, rec_state: torch.Tensor, rows) -> torch.Tensor:
    """One decode token per sequence: read the slots' states (rec_state[rows]), advance them by the delta
    rule, write them back, return o [N, H, V]. The reference; backends/fused/kernels/kda.py has the fused Triton form."""
    o, S = delta_rule_step(q, k, v, g, beta, rec_state[rows])
    rec_state[rows] = S
    return o


def kda_attention(cfg: ModelConfig, w: dict, prefix: str, x: torch.Tensor, step: Step,
                  conv_state: torch.Tensor, rec_state: torch.Tensor, recur=decode_recurrence,
                  l2norm=_l2norm) -> torch.Tensor:
    """x [N, D] -> [N, D]. conv_state [S, C, W-1], rec_state [S, H, K, V] fp32, both per cache slot.
    `recur`: the decode recurrence (decode_recurrence's signature); prefill always runs the reference loop.
    `l2norm`: q's and k's per-head normalisation (the validation harness plants a wrong one)."""
    N, H, K = x.shape[0], cfg.linear_num_heads, cfg.linear_head_dim
    W, p, f = cfg.conv_kernel, prefix, f"{prefix}.forget_gate"
    qkv = torch.cat([F.linear(x, w[f"{p}.{n}_proj.weight"]) for n in "qkv"], -1)  # [N, C]
    conv_w = w[f"{p}.conv1d.weight"][:, 0, :]  # [C, W]
    g = (F.linear(F.linear(x, w[f"{f}.f_a_proj.weight"]), w[f"{f}.f_b_proj.weight"]).float()
         + w[f"{f}.dt_bias"].float()).view(N, H, K)
    g = -w[f"{f}.A_log"].float().exp().view(1, H, 1) * F.softplus(g, threshold=20.0)
    beta = torch.sigmoid(F.linear(x, w[f"{p}.b_proj.weight"])).float()  # [N, H]

    def heads(mixed: torch.Tensor):  # [n, C] fp32 -> q, k, v [n, H, K], conv output rounded as the model dtype
        q, k, v = mixed.to(x.dtype).float().view(-1, 3, H, K).unbind(1)
        return l2norm(q) * K ** -0.5, l2norm(k), v

    if step.segments is None:
        # Decode: one token per sequence; read, advance and write back the slots' state (no host sync).
        rows = slice(0, N) if step.contiguous_slots else step.slots
        windows = torch.cat((conv_state[rows], qkv[:, :, None]), -1)  # [N, C, W]
        conv_state[rows] = windows[..., 1:]
        q, k, v = heads(_conv_silu(windows, conv_w))
        o = recur(q, k, v, g, beta, rec_state, rows)
    else:
        outs = []
        for j, (s, e, slot) in enumerate(step.segments):
            if step.seg_first is not None and step.seg_first[j] > 0:
                # It continues the slot's sequence: the conv's history and the state the slot holds.
                hist = conv_state[slot].to(qkv.dtype)
                S = rec_state[slot][None].float().clone()
            else:
                # A new sequence: zero conv history and zero state, whatever the slot held before.
                hist = qkv.new_zeros(qkv.shape[1], W - 1)
                S = torch.zeros(1, H, K, K, dtype=torch.float32, device=x.device)
            padded = torch.cat((hist, qkv[s:e].T), -1)  # [C, W-1 + n]
            q, k, v = heads(_conv_silu(padded.unfold(-1, W, 1).transpose(0, 1), conv_w))  # windows [n, C, W]
            states = []  # only for a trace: a prompt's would hold its length's worth of states
            for t in range(e - s):
                o_t, S = delta_rule_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[s + t:s + t + 1],
                                         beta[s + t:s + t + 1], S)
                outs.append(o_t)
                if step.state_trace is not None:
                    states.append(S[0])
            conv_state[slot] = padded[:, -(W - 1):]
            rec_state[slot] = S[0]
            if step.state_trace is not None:  # the conv's state after token t: the W-1 inputs ending at it
                conv = padded.unfold(-1, W - 1, 1).transpose(0, 1)[1:].to(conv_state.dtype)  # [n, C, W-1]
                step.state_trace.append(KdaTrace(conv_state, rec_state, slot, j, conv, torch.stack(states)))
        o = torch.cat(outs, 0)
    # Gated RMSNorm per head: the core output is rounded to the model dtype, then normed in fp32.
    gate = F.linear(F.linear(x, w[f"{p}.g_a_proj.weight"]), w[f"{p}.g_b_proj.weight"]).view(N, H, K)
    of = o.to(x.dtype).float()
    of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)
    of = of * w[f"{p}.o_norm.weight"].float() * torch.sigmoid(gate.float())
    return F.linear(of.to(x.dtype).reshape(N, H * K), w[f"{p}.o_proj.weight"])
