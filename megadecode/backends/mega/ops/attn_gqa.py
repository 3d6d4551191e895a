"""ATTN_GQA: GQA for (sequence b, kv head h, split s of S): q/k RMSNorm + RoPE of this token, the last split writes
k/v to the cache, then attention of the G query heads over the split's share of positions [0, pos] -> partials (m,
l, acc) at part_off + ((b * H + head) * S + s) * (d + 2). In a causal-rows program (rows that may continue one
sequence: a verify step) an F_KV_WRITE phase writes every row's k/v and the F_KV_READ attention after it writes none."""

from __future__ import annotations

import torch

from ..isa import F_KV_READ, F_KV_WRITE, bits_f32
from ..limits import KernelLimit
from ..pyvm_ops import rope, rms
from .opcode import Opcode

OP = Opcode("ATTN_GQA", ("attention", "op_attn_gqa"),
            dtypes={"kc": torch.bfloat16, "vc": torch.bfloat16, "qn_w": torch.bfloat16, "kn_w": torch.bfloat16,
                    "rope_w": torch.float32},
            produced=("kc", "vc"), lengths={"d": 8})


def check(prog, ins, where: str) -> None:
    a = ins.args
    if a["d"] > 128 or a["H"] // a["KH"] > 16:
        # (cute/attention.py gqa_chunk: a thread's 4 key pieces of 8 dims and 4 value dims of 32 groups cover
        # 128 dims; its 16 score sums, one per q head of the KV head)
        raise KernelLimit(f"{where}: head_dim {a['d']} with {a['H'] // a['KH']} q heads a KV head (GQA "
                          f"attention takes head_dim <= 128 and <= 16 q heads a KV head)")


def run(vm, ins, a) -> None:
    """ATTN_GQA in pyvm."""
    b, h, s, S, H, KH, d = (a[k] for k in ("b", "h", "s", "S", "H", "KH", "d"))
    G = H // KH
    pos, slot = int(vm.ri(a["pos_off"] + b, 1)), int(vm.ri(a["slot_off"] + b, 1))
    eps, att = bits_f32(a["eps_bits"]), bits_f32(a["att_bits"])
    inv = vm.T[a["rope_w"]]
    base = a["qkv_off"] + b * a["qkv_stride"]
    if not ins.flags & F_KV_WRITE:
        q = torch.stack([vm.rf(base + (h * G + g) * d, d) for g in range(G)])
        q = rope(rms(q, vm.T[a["qn_w"]], eps), pos, inv, att, False)
    L = pos + 1
    lo, hi = s * L // S, (s + 1) * L // S
    kv_only = bool(ins.flags & F_KV_WRITE)
    if kv_only or (s == S - 1 and not ins.flags & F_KV_READ):  # the token's key and value into the cache
        k = rope(rms(vm.rf(base + (H + h) * d, d), vm.T[a["kn_w"]], eps), pos, inv, att, False)
        vm.cache_row(a["kc"], (slot, pos, h), write=k)
        vm.cache_row(a["vc"], (slot, pos, h), write=vm.rf(base + (H + KH + h) * d, d))
    if kv_only:
        return
    dev = vm.f32.device
    m = torch.full((G,), float("-inf"), device=dev)
    lsum, acc = torch.zeros(G, device=dev), torch.zeros(G, d, device=dev)
    if hi > lo:
        K = torch.stack([vm.cache_row(a["kc"], (slot, p, h)).float() for p in range(lo, hi)])
        V = torch.stack([vm.cache_row(a["vc"], (slot, p, h)).float() for p in range(lo, hi)])
        sc = (q @ K.T) * bits_f32(a["scale_bits"])  # [G, n]
        m = sc.max(-1).values
        pr = torch.exp(sc - m[:, None])
        lsum, acc = pr.sum(-1), pr @ V
    for g in range(G):
        vm.wf(a["part_off"] + ((b * H + h * G + g) * S + s) * (d + 2),
                torch.cat((m[g:g + 1], lsum[g:g + 1], acc[g])))
