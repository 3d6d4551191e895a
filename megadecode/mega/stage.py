"""The weight stage: each CTA's shared-memory buffer of STAGE_BYTES that a bulk copy (`cp.async.bulk`, the TMA's
1-D form) fills with the static weight rows of an upcoming batch-1 MATVEC or GLU tile, started before the waits
that guard the activations those rows multiply.

Which instruction's rows go into the stage, and when, is planned here on the host from the CTA's queue (it runs
in order), and travels in two words of each row (isa.W_STAGE_ISSUE, isa.W_STAGE_ROWS):

- a *user* is a batch-1 MATVEC / GLU on the CUDA cores (not F_TC) whose weights are static tensors; the stage
  holds the first `stage_rows` rows of its tile (all of it when it fits; MATVEC an even count, as its warps take
  row pairs; GLU half the stage for the gate rows, half for the up rows);
- the *issuer* of a user is the first instruction of its queue after the previous user (or the queue's first):
  the earliest point at which the stage is free. Its start (before its own wait) copies the user's rows, so they
  stream while the instructions in between (attention, routing, the experts) run and wait.

So the stage holds at most one user's rows at a time, and every copy is consumed by the instruction it was made
for, later in the same queue. The kernel (cute_kernel.py) waits for each copy's mbarrier phase after its user's
body (bounded; a timeout is reported like a counter's), before any later copy reuses the buffer. Nothing produced
in the launch is ever staged: only static weights (`check`).
"""

from __future__ import annotations

from .isa import F_TC, STAGE_BYTES, Instr


def user_rows(ins: Instr, static: set[int] | None = None) -> int:
    """Rows of ins's tile that the stage holds (0: not a user). `static`: indices of the static tensors."""
    if ins.op not in ("MATVEC", "GLU") or ins.args["B"] != 1 or ins.flags & F_TC:
        return 0
    ws = (ins.args["w"],) if ins.op == "MATVEC" else (ins.args["wg"], ins.args["wu"])
    if static is not None and any(w not in static for w in ws):
        return 0
    rows, row_bytes = ins.args["r1"] - ins.args["r0"], 2 * ins.args["K"]
    cap = STAGE_BYTES // (len(ws) * row_bytes)
    n = min(rows, cap)
    if ins.op == "MATVEC" and n < rows:
        n -= n % 2  # warps take row pairs: a pair is staged whole or not at all
    return max(n, 0)


def plan(prog) -> None:
    """Set every instruction's stage words from the program's queues (schedule.schedule calls it)."""
    static = {i for i, t in enumerate(prog.tensors) if t.role == "static"}
    for ins in prog.instrs:
        ins.stage_issue, ins.stage_rows = -1, 0
    for q in prog.queues:
        free = 0  # the queue position from which the stage is free (after the last user)
        for pos, idx in enumerate(q):
            ins = prog.instrs[idx]
            n = user_rows(ins, static)
            if n == 0:
                continue
            ins.stage_rows = n
            prog.instrs[q[free]].stage_issue = idx
            free = pos + 1


def check(prog) -> None:
    """The plan's invariants, what the kernel relies on: each user's rows are copied exactly once, by an instruction
    at or before it in its own queue with no other user in between; only static tensors; the rows fit the stage."""
    static = {i for i, t in enumerate(prog.tensors) if t.role == "static"}
    seen: set[int] = set()
    for c, q in enumerate(prog.queues):
        pending = -1  # the user whose copy is in flight
        for idx in q:
            ins = prog.instrs[idx]
            if ins.stage_issue >= 0:
                if pending >= 0:
                    raise ValueError(f"CTA {c}: {ins.name} stages {prog.instrs[ins.stage_issue].name} while "
                                     f"{prog.instrs[pending].name}'s rows are still in the stage")
                pending = ins.stage_issue
                tgt = prog.instrs[pending]
                if tgt.stage_rows <= 0 or pending not in q or q.index(pending) < q.index(idx):
                    raise ValueError(f"CTA {c}: {ins.name} stages {tgt.name}, not a later user of its queue")
            if ins.stage_rows > 0:
                if pending != idx:
                    raise ValueError(f"CTA {c}: {ins.name} reads {ins.stage_rows} staged rows nobody copied")
                if ins.stage_rows > user_rows(ins, static):
                    raise ValueError(f"{ins.name}: {ins.stage_rows} staged rows, at most {user_rows(ins, static)} "
                                     f"fit the stage ({STAGE_BYTES} bytes) or are static weights")
                seen.add(idx)
                pending = -1
        if pending >= 0:
            raise ValueError(f"CTA {c}: {prog.instrs[pending].name}'s staged rows are never read")
    users = {i for i, ins in enumerate(prog.instrs) if ins.stage_rows > 0}
    if users != seen:
        raise ValueError(f"staged instructions outside every queue: {sorted(users - seen)[:5]}")
