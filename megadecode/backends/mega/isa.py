"""The megakernel's instruction set: one instruction is one tile of one op of the decode step.

An instruction is a small dataclass that serializes to a fixed-width row of int32 (ROW ints):

    0 opcode   1 layer   2 signal counter (-1: none)   3 flags
    4..6   wait 0: counter, count needed, count per launch   (counter -1: no wait)
    7..9   wait 1: the same
    10..12 the static bytes the instruction streams, to prefetch before its wait: tensor (-1: none), offset and
           length in 16-byte units
    13..   arguments (ARGS ints; their meaning per opcode is in OPS)
    38     the next instruction of the same CTA's queue after this one whose static bytes (10..12) the weight ring
           streams (F_STAGE; -1: none; written by Program.rows), so that the ring's issuer walks only those
    39     the next instruction of the same CTA's queue (-1: the last; written by Program.rows from the schedule),
           so that the kernel copies that row into shared memory while this one runs

Dependencies are counters in global memory. An instruction waits until each of its counters reached its
count for this launch, then runs, then (after its stores) adds 1 to its signal counter with release semantics.
Counters are never reset: launch number e (1, 2, ... read from device memory) waits for
`(e - 1) * per_launch + need`, compared in wrapping int32 arithmetic, so CUDA-graph replays need no reset
kernel and the counters may wrap.

Buffers: activations live in one fp32 arena and routing/step data in one int32 arena (offsets in elements);
static weights and the KV cache are tensors in a table (indices). `ARGS` below names each opcode's arguments in
order; `Instr.args` holds them by name, so a row can be printed and checked.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

ROW = 40  # int32 per instruction
PASS = 4  # tokens (or expert pairs) per pass of the kernel's dot-product loops (its TB)
HEADER = 13
W_NEXT = ROW - 1  # row word: the next instruction of the CTA's queue (-1: none)
W_STAGE = ROW - 2  # row word: the next staged (F_STAGE) instruction of the CTA's queue after this one (-1: none)
TLW = 8  # timeline words per instruction (MegaRuntime(timeline=True)): wait start, work start, end, SM, 4 body marks
ARGS = ROW - HEADER

# flags
F_NORM = 1  # MATVEC/GLU: RMSNorm the input rows first (weight `norm_w`, eps `eps`)
F_RESID = 2  # MATVEC: out = out + W x (the residual stream, in place)
F_WRITE_NORMED = 4  # MATVEC: the tile with r0 == 0 also writes the normed input rows to `normed_off`
F_SIGMOID = 8  # ROUTE: sigmoid scores with selection bias (DeepSeek noaux_tc); else softmax
F_RENORM = 16  # ROUTE: renormalise the picked weights
F_INTERLEAVED = 32  # rope pairs (2i, 2i+1) (DeepSeek); else (i, i + d/2) (Qwen)
F_SHARED = 64  # EXPERT_DOWN / COMBINE: add the shared experts' output (`shared_off`)
F_GREEDY = 128  # SAMPLE: argmax; else temperature sampling by a Gumbel race
F_MXFP4 = 256  # EXPERT_UP / EXPERT_DOWN: MXFP4 experts (packed e2m1 tensor + e8m0 scale tensor)
F_SITU = 512  # EXPERT_UP: SiTU-GLU (Kimi K3's routed experts); else SwiGLU
F_STORE = 1024  # EXPERT_DOWN / COMBINE: write the weighted sum of the experts (K3's latent z); else add it to `out`
F_NOPE = 2048  # MLA_KV / MLA_Q: no rotary embedding (kimi_linear / kimi_k3's NoPE MLA)
F_PAIR1 = 4096  # EXPERT_UP (bf16): one (expert, token) pair per pass, as MXFP4 always takes (`up_passes`)
F_TC = 8192  # MATVEC / GLU: rows on the tensor cores (`tc_input`): batch >= 2, K a multiple of TC_K
F_FRAG = 16384  # EXPERT_UP / EXPERT_DOWN (with F_MXFP4): weights in fragment order (quant/mxfp4_frag.py), tensor cores
F_ROUTE = 32768  # EXPERT_UP (batch 1, softmax scores): each item picks the experts itself from the router's logits
# (ROUTE's batch-1 semantics), item w = 0 also writing ROUTE's outputs; the layer has no ROUTE phase
F_KV_WRITE = 65536  # ATTN_GQA: only write the token's key and value to the cache (a causal-rows program's write phase)
F_KV_READ = 131072  # ATTN_GQA: attention over the cache only, its rows written by an F_KV_WRITE phase before
F_STAGE = 262144  # MATVEC (batch 1, CUDA cores): its rows (the static bytes, words 10..12) come through the CTA's
# weight ring, streamed ahead of its wait (Program.rows sets it: `stageable`); no change to what it computes
F_GROUP = 1048576  # EXPERT_UP / EXPERT_DOWN (bf16): grouped on the tensor cores, each selected expert's 16-row
# tiles against GROUP_N of its pairs at once (a pass, `group_prefix`), so its rows are read once per GROUP_N pairs,
# not once per pair; EXPERT_DOWN pair-major (y alone), the weighted sum the next phase's COMBINE, as under F_FRAG
F_PICKS = 2097152  # ROUTE: the scores, picks and weights of tokens [t0, t1) alone, no tables (a split ROUTE: the
# picks of the batch's token groups on several CTAs at once; the tables are the next phase's one ROUTE, F_TABLES)
F_TABLES = 4194304  # ROUTE: the tables alone, from the B tokens' picks in ids (written by the F_PICKS phase)
FRAG_TILE = 16  # rows of a fragment-order record: EXPERT_UP's unit of work under F_FRAG (a gate tile and its up tile)
FRAG_DOWN = 2 * FRAG_TILE  # EXPERT_DOWN's unit of work under F_FRAG: two adjacent row tiles of one pair
TC_K = 32  # k per tensor-core step of a warp (4 lane groups x 8 consecutive k: 2 mma.sync m16n8k16)

# opcodes, with their argument names (in row order)
OPS: dict[str, tuple[int, tuple[str, ...]]] = {
    "NOP": (0, ()),
    # hidden[t, c0:c1] = embed[tokens[t], c0:c1]
    "EMBED": (1, ("w", "tok_off", "out_off", "D", "B", "c0", "c1")),
    # out[t, out_col + r] (+)= W[r, :K] . f(x[t, :K] (+ x2[t, :K])) (+ add0[t, r] + add1[t, r]) for r in [r0, r1),
    # t < B; f = RMSNorm when F_NORM; x2 / add0 / add1 offsets -1: none (same strides as x / out)
    "MATVEC": (2, ("w", "K", "x_off", "x_stride", "out_off", "out_stride", "out_col", "r0", "r1", "B",
                   "norm_w", "eps_bits", "normed_off", "x2_off", "add0_off", "add1_off")),
    # out[t, out_col + r] = silu(Wg[r] . f(x_t)) * (Wu[r] . f(x_t))
    "GLU": (3, ("wg", "wu", "K", "x_off", "x_stride", "out_off", "out_stride", "out_col", "r0", "r1", "B",
                "norm_w", "eps_bits", "x2_off")),
    # GQA for (sequence b, kv head h, split s of S): q/k RMSNorm + RoPE of this token, the last split writes k/v
    # to the cache, then attention of the G query heads over the split's share of positions [0, pos] ->
    # partials (m, l, acc) at part_off + ((b * H + head) * S + s) * (d + 2)
    "ATTN_GQA": (4, ("kc", "vc", "qkv_off", "qkv_stride", "qn_w", "kn_w", "pos_off", "slot_off", "b", "h", "s",
                     "S", "H", "KH", "d", "part_off", "scale_bits", "eps_bits", "rope_w", "att_bits", "Lmax")),
    # o[b, head*dv:(head+1)*dv] = merge of the S partials of (b, head) [MLA: then W_UV of the head; K3: then
    # times sigmoid(gate[b, head*dv + v]) (gate_off -1: no gate)]
    "MERGE": (5, ("part_off", "out_off", "out_stride", "b", "h", "S", "H", "d", "wuv", "dv", "P", "gate_off")),
    # routing for the whole batch: picks, weights, and the pairs grouped by expert (see backends/mega/lower.py)
    # (also each expert's passes of PASS pairs, as a prefix: qst[u] = sum over u' < u of ceil(pairs(u') / PASS))
    "ROUTE": (6, ("logits_off", "E", "A", "B", "bias_w", "n_group", "topk_group", "scale_bits", "ids_off",
                  "wts_off", "nuniq_off", "uniq_off", "pstart_off", "ptok_off", "pslot_off", "pairof_off", "qst_off",
                  "t0", "t1")),
    # h[pair, i] = glu(gate_up[e] . x_t) for the units [w * N / W, (w + 1) * N / W) of N = pre[nuniq] * I: unit
    # pre[u] * I + q * I + r is row r of expert u against its pairs [q * P, (q + 1) * P) (`up_chunks`), P and the
    # pass prefix `pre` by `up_passes`: bf16 qst (PASS pairs a pass), MXFP4 pstart (one pair a pass)
    # F_ROUTE: the routing first, from the logits at logits_off (E experts, A picks, F_RENORM, scale_bits), as ROUTE at
    # batch 1; item w = 0 writes ids, wts and the tables (ROUTE's outputs, which EXPERT_DOWN reads)
    "EXPERT_UP": (7, ("gu", "I", "D", "x_off", "h_off", "w", "W", "nuniq_off", "uniq_off", "pstart_off",
                      "ptok_off", "gus", "qst_off", "logits_off", "E", "A", "scale_bits", "ids_off", "wts_off",
                      "pslot_off", "pairof_off")),
    # for rows [r0, r1) of every selected expert: y[pair] = down[e] . h[pair]; then
    # hidden[t, r] += sum_a wts[t, a] * y[pair_of(t, a), r] (+ shared[t, r]). F_FRAG: y alone, for the units
    # [w * N / W, (w + 1) * N / W) of N = pairs x D / FRAG_DOWN, pair-major (`up_chunks` over the pair prefix with
    # unit FRAG_DOWN); the weighted sum is the next phase's COMBINE
    "EXPERT_DOWN": (8, ("dn", "I", "D", "h_off", "y_off", "out_off", "r0", "r1", "B", "A", "nuniq_off",
                        "uniq_off", "pstart_off", "wts_off", "pairof_off", "shared_off", "dns", "w", "W")),
    # next token of sequence b from logits [B, V] (greedy, or temperature with the step's seed)
    "SAMPLE": (9, ("logits_off", "V", "b", "tok_out_off", "lp_out_off", "seed_off", "inv_temp_bits")),
    # MLA: the token's latent (RMSNorm) and rope key (rotated) into the cache
    "MLA_KV": (10, ("cache", "kva_off", "kva_stride", "norm_w", "C", "R", "pos_off", "slot_off", "b", "eps_bits",
                    "rope_w", "att_bits", "Lmax")),
    # MLA: q_lat[b, head] = W_UK[head]^T q_nope, q_pe rotated
    "MLA_Q": (11, ("wkv", "qb_off", "qb_stride", "qlat_off", "qpe_off", "b", "h", "H", "P", "R", "C", "V",
                   "pos_off", "rope_w", "att_bits")),
    # MLA attention for (b, head block [h0, h0 + HB), split s of S) over the latent cache -> partials
    "MLA_ATTN": (12, ("cache", "qlat_off", "qpe_off", "pos_off", "slot_off", "b", "h0", "HB", "s", "S", "H",
                      "C", "R", "part_off", "scale_bits", "Lmax")),
    # Block Attention Residuals (kimi_k3) for token b, columns [c0, c1): the attention of query_w over the
    # RMSNorm'd sources (nsrc consecutive [B, D] blocks at src_off) -> out[b, c0:c1] = sum_s alpha_s src_s
    "ATTN_RES": (13, ("src_off", "nsrc", "B", "D", "query_w", "norm_w", "eps_bits", "out_off", "b", "c0", "c1")),
    # KDA decode for (sequence b, head h): short conv step, l2norm, gates, the delta-rule recurrence on the
    # slot's fp32 state (read and written once), gated RMSNorm -> out[b, h*K:(h+1)*K]
    "KDA_STEP": (14, ("qkv_off", "f_off", "gate_off", "beta_off", "conv_w", "conv_state", "rec_state", "a_log",
                      "dt_bias", "onorm_w", "out_off", "b", "h", "H", "K", "W", "slot_off", "eps_bits")),
    # hidden[t, r] (+)= sum_a wts[t, a] * y[pair_of(t, a), r] (+ shared[t, r]) for rows [r0, r1), t < B: the
    # weighted sum of the experts' outputs that EXPERT_DOWN fuses, as its own phase after F_FRAG's pair-major items
    "COMBINE": (15, ("y_off", "out_off", "D", "r0", "r1", "B", "A", "wts_off", "pairof_off", "shared_off")),
}
OPCODES = {name: code for name, (code, _) in OPS.items()}
OPNAMES = {code: name for name, (code, _) in OPS.items()}
for _name, (_, _args) in OPS.items():
    assert len(_args) < ARGS - 1, (_name, len(_args))  # W_STAGE and W_NEXT follow the arguments


# bf16 EXPERT_UP takes one pair a pass (F_PAIR1) up to this batch. Measured on the H200 (bench/mega_lower_ab.py,
# qwen3-30b-a3b): up to 16 tokens, 23.5 -> 19.3 ms a step at batch 16; up to 64, no gain at 64 (66.2 -> 74.7 ms)
PAIR1_MAX_B = 16
# up to this batch a softmax-routed MoE layer of bf16 experts without shared experts (qwen3-moe) has no ROUTE phase:
# its EXPERT_UP items route the token themselves (F_ROUTE). Why: ROUTE is one instruction on one CTA while the GPU
# waits, and EXPERT_UP then reads its tables back in dependent trips (qwen3-30b-a3b batch 1 on the H200: ROUTE 9.7 us
# of a 107 us layer, its phase and hand-overs ~10.5; docs/megakernel.md)
ROUTE_IN_UP_MAX_B = 1
# past this batch ROUTE's scores, picks and weights are a phase of instructions of ROUTE_TOKENS tokens on as many
# CTAs (F_PICKS), its tables one instruction after them (F_TABLES). Why: one ROUTE instruction takes the batch's
# tokens 8 at a time (a warp each) on one CTA while the GPU waits: its scores and picks were 15 us a layer at
# qwen3-30b-a3b batch 17 and 37 at 64 (the kernel's marks, docs/megakernel.md)
ROUTE_SPLIT_B = 8
ROUTE_TOKENS = 8  # a round of the kernel's warps (a token a warp)


# bf16 experts are grouped (F_GROUP) from this batch: at qwen3-30b-a3b batch 64 the pass loop on the CUDA cores
# (PASS pairs a pass) made the step 2.8x `fused`'s, which reads each selected expert once (docs/megakernel.md)
GROUP_MIN_B = PAIR1_MAX_B + 1
GROUP_N = 8  # pairs a pass under F_GROUP: the mma's N
GROUP_TILE = 16  # rows a unit under F_GROUP: the mma's M (a warp's rows)
GROUP_MAX_E = 512  # experts under F_GROUP: its tables take 3 shared int words an expert (cute/moe.py group_tables)


def group_prefix(pstart: list[int]) -> list[int]:
    """F_GROUP's pass prefix: selected expert u holds ceil(pairs / GROUP_N) passes, pass q its pairs
    pstart[u] + GROUP_N q onwards (the kernel computes the same prefix from ROUTE's pstart)."""
    out = [0]
    for u in range(len(pstart) - 1):
        out.append(out[-1] + -(-(pstart[u + 1] - pstart[u]) // GROUP_N))
    return out


def up_passes(flags: int) -> tuple[int, str]:
    """EXPERT_UP's pairs per pass and the argument holding its pass prefix. MXFP4 experts, and bf16 ones under
    F_PAIR1, take one (expert, token) pair per pass, so the prefix is ROUTE's pair prefix `pstart`: every pass runs
    the kernel's single-pair loop, which streams several rows per warp, and a row serving several pairs is read once
    per pair (the repeats from L2). With PASS pairs a pass an item holding passes of several pairs waits on the
    general loop and the phase waits for that item: MXFP4 at k3-mini batch 8, 2.3-3.6x the time of a single-pair
    item for the same rows (H200 timelines); bf16 at qwen3-30b-a3b batch 8, 1.8x / 2.0x for passes of 2 / 3
    pairs. Other bf16 experts keep PASS pairs a pass (`qst`): the general loop reads each weight once
    for all of a pass's pairs, which is the better trade when experts hold many pairs (PAIR1_MAX_B)."""
    return (1, "pstart_off") if flags & (F_MXFP4 | F_PAIR1) else (PASS, "qst_off")


def up_chunks(qst: list[int], I: int, w: int, W: int, unit: int = 1) -> list[tuple[int, int, int, int]]:
    """EXPERT_UP's share of work item w of W: (u, q, r0, r1) = rows [r0, r1) of selected expert u against its
    pairs' pass q, `qst` the pass prefix (`up_passes`). The N = qst[-1] * I / unit units (`unit` rows of a pass:
    one, or F_FRAG's FRAG_TILE) are split evenly, so an item's weight rows and decode work are the same for every
    w to within one unit, whatever the pairs per expert (the kernel walks the same chunks,
    `backends/mega/cute/moe.py`)."""
    per = I // unit
    N = qst[-1] * per
    lo, hi = w * N // W, (w + 1) * N // W
    out = []
    for u in range(len(qst) - 1):
        for q in range(qst[u + 1] - qst[u]):
            base = (qst[u] + q) * per
            r0, r1 = max(lo - base, 0), min(hi - base, per)
            if r0 < r1:
                out.append((u, q, r0 * unit, r1 * unit))
    return out


def f32_bits(x: float) -> int:
    """The int32 holding fp32 `x`'s bits (how float arguments travel in a row)."""
    return struct.unpack("<i", struct.pack("<f", float(x)))[0]


def bits_f32(b: int) -> float:
    return struct.unpack("<f", struct.pack("<i", int(b)))[0]


@dataclass
class Wait:
    counter: int
    need: int  # instructions of this launch that must have signalled
    per_launch: int  # instructions that signal the counter per launch


@dataclass
class Instr:
    op: str
    layer: int
    args: dict[str, int]
    signal: int = -1
    waits: list[Wait] = field(default_factory=list)
    flags: int = 0
    # scheduling: estimated bytes moved from HBM and flops (the cost model)
    bytes: int = 0
    flops: int = 0
    name: str = ""  # e.g. "L3.qkv[5]", for printing
    prefetch: tuple[int, int, int] = (-1, 0, 0)  # (tensor, byte offset, bytes) of static data read, or none

    def row(self) -> list[int]:
        code, names = OPS[self.op]
        unknown = set(self.args) - set(names)
        missing = [n for n in names if n not in self.args]
        if unknown or missing:
            raise ValueError(f"{self.name or self.op}: unknown args {sorted(unknown)}, missing {missing}")
        if len(self.waits) > 2:
            raise ValueError(f"{self.name}: at most 2 waits, got {len(self.waits)}")
        r = [code, self.layer, self.signal, self.flags]
        for i in range(2):
            w = self.waits[i] if i < len(self.waits) else Wait(-1, 0, 0)
            r += [w.counter, w.need, w.per_launch]
        t, off, n = self.prefetch
        if off % 16 or n % 16:
            raise ValueError(f"{self.name}: prefetch range ({off}, {n}) is not in 16-byte units")
        r += [t, off // 16, n // 16]
        r += [int(self.args[n]) for n in names]
        r += [0] * (ROW - len(r))
        for v in r:
            if not -2**31 <= v < 2**31:
                raise ValueError(f"{self.name}: value {v} does not fit int32")
        return r

    @staticmethod
    def from_row(r: list[int]) -> "Instr":
        name = OPNAMES[r[0]]
        names = OPS[name][1]
        waits = [Wait(r[4 + 3 * i], r[5 + 3 * i], r[6 + 3 * i]) for i in range(2) if r[4 + 3 * i] >= 0]
        return Instr(name, r[1], {n: r[HEADER + i] for i, n in enumerate(names)}, signal=r[2], waits=waits,
                     flags=r[3], prefetch=(r[10], 16 * r[11], 16 * r[12]))

    def describe(self) -> str:
        waits = " ".join(f"wait c{w.counter}>={w.need}/{w.per_launch}" for w in self.waits)
        sig = f" -> c{self.signal}" if self.signal >= 0 else ""
        return f"{self.name or self.op:<24} {self.op:<11} {waits}{sig}  {self.bytes / 1e3:.1f} kB"


def tc_input(x, g=None):
    """What F_TC multiplies with the bf16 rows: the (fp32) input rows times the norm weight g when the instruction
    norms (before the rstd, which multiplies the sums), as the sum of two bf16 values, hi (the value rounded to
    nearest even) and lo (the remainder, exact in fp32, rounded alike); fp32 values of a torch tensor. The kernel's
    mma.sync m16n8k16 takes bf16 operands and sums the exact products in fp32, once against hi and once against lo,
    so hi + lo is the input pyvm holds it to: within 2**-16 of the fp32 input relatively. Why not one bf16 rounding
    (hi) alone: the kernel's sums then jump by a bf16 step wherever its fp32 input and pyvm's, equal up to the sums'
    order, fall on two sides of a rounding boundary (1.6e-3 / 3.4e-3 from pyvm over 4 decode steps of
    tiny-deepseek-v3 / tiny-k3 at batch 4 on the H200, against 1e-3 allowed)."""
    import torch

    xg = x.float() * g.float() if g is not None else x.float()
    hi = xg.to(torch.bfloat16).float()
    return hi + (xg - hi).to(torch.bfloat16).float()
