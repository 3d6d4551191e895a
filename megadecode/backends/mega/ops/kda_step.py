"""KDA_STEP: KDA decode for (sequence b, head h): short conv step, l2norm, gates, the delta-rule recurrence on the
slot's fp32 state (read and written once), gated RMSNorm -> out[b, h*K:(h+1)*K]"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..isa import bits_f32
from ..limits import NT, SMEM_F, KernelLimit
from .opcode import Opcode

OP = Opcode("KDA_STEP", ("k3", "op_kda_step"),
            dtypes={"conv_w": torch.bfloat16, "conv_state": torch.bfloat16, "rec_state": torch.float32,
                    "a_log": torch.bfloat16, "dt_bias": torch.bfloat16, "onorm_w": torch.bfloat16},
            produced=("conv_state", "rec_state"))


def check(prog, ins, where: str) -> None:
    a = ins.args
    if 6 * a["K"] + max(NT, a["K"]) + 4 > SMEM_F:
        raise KernelLimit(f"{where}: KDA head dim {a['K']} does not fit the step's shared memory")


def run(vm, ins, a) -> None:
    """KDA_STEP in pyvm."""
    b, h, H, K = a["b"], a["h"], a["H"], a["K"]
    HK = H * K
    slot = int(vm.ri(a["slot_off"] + b, 1))
    conv_w = vm.T[a["conv_w"]][:, 0, :].float()  # [3HK, W]
    ch = torch.cat([torch.arange(j * HK + h * K, j * HK + (h + 1) * K) for j in range(3)])  # q, k, v channels
    raw = torch.cat([vm.rf(a["qkv_off"] + b * 3 * HK + j * HK + h * K, K) for j in range(3)])
    hist = torch.stack([vm.cache_row(a["conv_state"], (slot, int(c))) for c in ch]).float()  # [3K, W-1]
    window = torch.cat((hist, raw[:, None]), -1)  # [3K, W], oldest first
    for j, c in enumerate(ch.tolist()):
        vm.cache_row(a["conv_state"], (slot, c), write=window[j, 1:])
    mixed = F.silu((window * conv_w[ch.to(conv_w.device)]).sum(-1))
    q, k, v = mixed[:K], mixed[K:2 * K], mixed[2 * K:]
    q = q / torch.sqrt((q * q).sum() + 1e-6) * K ** -0.5
    k = k / torch.sqrt((k * k).sum() + 1e-6)
    f = vm.rf(a["f_off"] + b * HK + h * K, K) + vm.T[a["dt_bias"]][h * K:(h + 1) * K].float()
    g = -vm.T[a["a_log"]].float().reshape(-1)[h].exp() * F.softplus(f, threshold=20.0)
    beta = torch.sigmoid(vm.rf(a["beta_off"] + b * H + h, 1))
    S = vm.cache_row(a["rec_state"], (slot, h)).float()  # [K, V]
    S = S * g.exp()[:, None]
    S = S + k[:, None] * ((v - k @ S) * beta)[None, :]
    vm.cache_row(a["rec_state"], (slot, h), write=S)
    o = q @ S
    o = o * torch.rsqrt(o.pow(2).mean() + bits_f32(a["eps_bits"])) * vm.T[a["onorm_w"]].float()
    o = o * torch.sigmoid(vm.rf(a["gate_off"] + b * HK + h * K, K))
    vm.wf(a["out_off"] + b * HK + h * K, o)
