"""What the CuTe kernel assumes of a program, checked before the launch (on the host, no GPU needed): the dtype of
every tensor an instruction names, the lengths its vector loops step through 8 at a time, the 16-byte alignment of
the activation rows those loops load, and the shared-memory bounds of the bodies that size their tiles at run time.
A program that breaks one is refused with the instruction and the reason, instead of reading past a row or
reinterpreting a tensor's bytes inside the kernel."""

from __future__ import annotations

import torch

from ...quant.mxfp4_frag import KREC, RECORD
from .isa import F_FRAG, F_MXFP4, F_TC, FRAG_TILE, TC_K
from .program import Program

NT = 256  # threads per CTA (cute/base.py; kept here so this check imports no CuTe)
SMEM_F = 12288  # fp32 words of shared memory per CTA (cute/base.py)
MLA_HB = 8  # the most heads an MLA_ATTN instruction may hold (cute/attention.py: its score sums per thread)
BODY_I = 2048 - 112  # int32 shared words a body may use, below the two instruction rows (cute/base.py)

BF16, F32, U8 = torch.bfloat16, torch.float32, torch.uint8

# (opcode, argument) -> the dtype the kernel reads it as. EXPERT_UP/DOWN's weights are uint8 under F_MXFP4.
DTYPES: dict[tuple[str, str], torch.dtype] = {
    ("EMBED", "w"): BF16,
    ("MATVEC", "w"): BF16, ("MATVEC", "norm_w"): BF16,
    ("GLU", "wg"): BF16, ("GLU", "wu"): BF16, ("GLU", "norm_w"): BF16,
    ("ATTN_GQA", "kc"): BF16, ("ATTN_GQA", "vc"): BF16, ("ATTN_GQA", "qn_w"): BF16, ("ATTN_GQA", "kn_w"): BF16,
    ("ATTN_GQA", "rope_w"): F32,
    ("MERGE", "wuv"): BF16,
    ("ROUTE", "bias_w"): F32,
    ("EXPERT_UP", "gu"): BF16, ("EXPERT_DOWN", "dn"): BF16,
    ("MLA_KV", "cache"): BF16, ("MLA_KV", "norm_w"): BF16, ("MLA_KV", "rope_w"): F32,
    ("MLA_Q", "wkv"): BF16, ("MLA_Q", "rope_w"): F32,
    ("MLA_ATTN", "cache"): BF16,
    ("ATTN_RES", "query_w"): BF16, ("ATTN_RES", "norm_w"): BF16,
    ("KDA_STEP", "conv_w"): BF16, ("KDA_STEP", "conv_state"): BF16, ("KDA_STEP", "rec_state"): F32,
    ("KDA_STEP", "a_log"): BF16, ("KDA_STEP", "dt_bias"): BF16, ("KDA_STEP", "onorm_w"): BF16,
}
MXFP4_ARGS = {("EXPERT_UP", "gu"), ("EXPERT_UP", "gus"), ("EXPERT_DOWN", "dn"), ("EXPERT_DOWN", "dns")}
# (opcode, argument) the kernel writes during the launch and reads its address from the produced table (`ptab`);
# every other tensor argument, and the static bytes an instruction declares (header words 10..12), come from the
# static table (`wtab`), whose loads may take the non-coherent path (backends/mega/spec.py). A tensor in the wrong table
# would be read as address 0
PRODUCED_ARGS = {("ATTN_GQA", "kc"), ("ATTN_GQA", "vc"), ("MLA_KV", "cache"), ("MLA_ATTN", "cache"),
                 ("KDA_STEP", "conv_state"), ("KDA_STEP", "rec_state")}

# (opcode, argument) -> the multiple the kernel's 8-wide loops need (MXFP4 rows: a whole 32-weight block)
LENGTHS = {("MATVEC", "K"): 8, ("GLU", "K"): 8, ("ATTN_GQA", "d"): 8, ("MLA_KV", "C"): 8, ("MLA_KV", "R"): 8,
           ("MLA_ATTN", "C"): 8, ("MLA_ATTN", "R"): 8, ("EXPERT_UP", "D"): 8, ("EXPERT_DOWN", "I"): 8,
           ("ATTN_RES", "D"): 8}
# fp32 activation offsets and strides the vector loops load 8 at a time from (16-byte alignment: multiples of 4)
ALIGNED = {"MATVEC": ("x_off", "x_stride", "x2_off"), "GLU": ("x_off", "x_stride", "x2_off"),
           "EXPERT_UP": ("x_off", "D"), "EXPERT_DOWN": ("h_off", "I"), "ATTN_RES": ("src_off", "D")}


class KernelLimit(ValueError):
    """A program the CuTe kernel cannot run as written, naming the instruction and the reason."""


def _tensor_args(op: str) -> list[str]:
    return sorted({a for (o, a) in DTYPES if o == op} | {a for (o, a) in MXFP4_ARGS if o == op})


def check_program(prog: Program) -> None:
    """Raise KernelLimit for the first instruction the CuTe kernel would read wrongly."""
    for ins in prog.instrs:
        a, op, where = ins.args, ins.op, ins.name or ins.op
        mx = bool(ins.flags & F_MXFP4)
        for name in _tensor_args(op):
            t = a.get(name, -1)
            if t < 0:
                continue
            role = "produced" if (op, name) in PRODUCED_ARGS else "static"
            if prog.tensors[t].role != role:
                raise KernelLimit(f"{where}: {name} ({prog.tensors[t].name}) is {prog.tensors[t].role}; the "
                                  f"megakernel reads it from the {role} table")
            want = U8 if mx and (op, name) in MXFP4_ARGS else DTYPES.get((op, name))
            got = prog.tensors[t].tensor.dtype
            if want is not None and got != want:
                raise KernelLimit(f"{where}: {name} ({prog.tensors[t].name}) is {got}; the megakernel reads it as "
                                  f"{want}")
        t = ins.prefetch[0]
        if t >= 0 and prog.tensors[t].role != "static":
            raise KernelLimit(f"{where}: declares {prog.tensors[t].name} ({prog.tensors[t].role}) as static bytes "
                              f"to stream")
        for (o, name), m in LENGTHS.items():
            if o == op:
                need = 32 if mx else m
                if a[name] % need:
                    raise KernelLimit(f"{where}: {name} = {a[name]} is not a multiple of {need} (the kernel's "
                                      f"{'MXFP4 blocks' if mx else 'vector loads'})")
        for name in ALIGNED.get(op, ()):
            if a.get(name, -1) > 0 and a[name] % 4:
                raise KernelLimit(f"{where}: {name} = {a[name]} is not a multiple of 4 fp32 (16-byte vector loads)")
        if op in ("MATVEC", "GLU") and a["B"] > 64:
            raise KernelLimit(f"{where}: {a['B']} rows (the norm's per-row scales hold 64)")
        if op == "MERGE" and a["wuv"] >= 0 and (a["d"] % 8 or a["d"] > SMEM_F - 128):
            # (the merged latent in shared words 0 .. d; the splits' maxima and weights in the last 128)
            raise KernelLimit(f"{where}: latent width {a['d']} (a multiple of 8, at most {SMEM_F - 128})")
        if op == "MERGE" and a["S"] > 64:
            raise KernelLimit(f"{where}: {a['S']} attention splits (MERGE's split weights take 64 shared words)")
        if op == "KDA_STEP" and 6 * a["K"] + max(NT, a["K"]) + 4 > SMEM_F:
            raise KernelLimit(f"{where}: KDA head dim {a['K']} does not fit the step's shared memory")
        if op == "ROUTE" and 2 * a["E"] + 3 * 8 > BODY_I:
            # (this also bounds EXPERT_UP's shared pass table: at most min(E, B * A) + 1 <= E + 1 words)
            raise KernelLimit(f"{where}: {a['E']} experts (ROUTE's per-expert counts and starts, and its scan, "
                              f"take 2 E + 24 of the {BODY_I} shared int words below the instruction rows)")
        if op == "MLA_ATTN" and a["HB"] > MLA_HB:
            raise KernelLimit(f"{where}: {a['HB']} heads in one MLA attention instruction (at most {MLA_HB})")
        if op in ("MATVEC", "GLU") and ins.flags & F_TC and (a["K"] % TC_K or a["B"] < 2):
            raise KernelLimit(f"{where}: F_TC (tensor-core rows) needs K a multiple of {TC_K} and 2 tokens or more; "
                              f"K = {a['K']}, B = {a['B']}")
        if op == "ROUTE" and 2 * a["B"] * a["A"] > SMEM_F:
            raise KernelLimit(f"{where}: {a['B']} x {a['A']} (token, expert) pairs (ROUTE's picks and their ranks "
                              f"take 2 shared fp32 words each, of {SMEM_F})")
        if op == "EXPERT_DOWN" and a["B"] * a["A"] > BODY_I:
            # (its pair -> expert table, one shared int word per (token, slot) pair: MXFP4 always, bf16 when every
            # selected expert holds one pair)
            raise KernelLimit(f"{where}: {a['B']} x {a['A']} (token, expert) pairs (EXPERT_DOWN's pair table takes "
                              f"one of the {BODY_I} shared int words below the instruction rows each)")
        if op in ("EXPERT_UP", "EXPERT_DOWN") and ins.flags & F_FRAG:
            _check_frag(prog, ins, where)
        if op == "ATTN_GQA" and (a["d"] > 128 or a["H"] // a["KH"] > 16):
            # (cute/attention.py gqa_chunk: a thread's 4 key pieces of 8 dims and 4 value dims of 32 groups cover
            # 128 dims; its 16 score sums, one per q head of the KV head)
            raise KernelLimit(f"{where}: head_dim {a['d']} with {a['H'] // a['KH']} q heads a KV head (GQA "
                              f"attention takes head_dim <= 128 and <= 16 q heads a KV head)")
        if op == "ATTN_RES" and a["nsrc"] > SMEM_F:
            raise KernelLimit(f"{where}: {a['nsrc']} AttnRes sources")


def _check_frag(prog: Program, ins, where: str) -> None:
    """F_FRAG (the tensor-core expert bodies, cute/moe.py): MXFP4 records of quant/mxfp4_frag.py's shape for the
    instruction's dims, reductions whole records (256), EXPERT_UP's gate / up split on a tile boundary, its staged
    row within shared memory and EXPERT_DOWN's rows whole tiles. EXPERT_UP's pair table shares EXPERT_DOWN's bound
    (one shared int word a pair, checked on the layer's EXPERT_DOWN). F_FRAG without F_MXFP4 is refused by the dtype
    check (records are uint8, bf16 experts are not)."""
    a = ins.args
    up = ins.op == "EXPERT_UP"
    I, D = a["I"], a["D"]
    R, K = (2 * I, D) if up else (D, I)
    w = prog.tensors[a["gu" if up else "dn"]].tensor
    if up and D + 8 > SMEM_F:
        raise KernelLimit(f"{where}: latent width {D} (EXPERT_UP stages a pair's row as two fp16 planes and 8 words "
                          f"in {SMEM_F} shared fp32 words: D <= {SMEM_F - 8})")
    if K % KREC or I % FRAG_TILE or tuple(w.shape[1:]) != (R // FRAG_TILE, K // KREC, RECORD):
        raise KernelLimit(f"{where}: fragment-order experts need records [E, {R}/{FRAG_TILE}, {K}/{KREC}, {RECORD}] "
                          f"(K a multiple of {KREC}, I of {FRAG_TILE}); got {tuple(w.shape)} for I = {I}, D = {D}")
    if not up and (a["r0"] % FRAG_TILE or a["r1"] % FRAG_TILE):
        raise KernelLimit(f"{where}: rows [{a['r0']}, {a['r1']}) are not whole {FRAG_TILE}-row tiles")
