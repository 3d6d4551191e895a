"""The megakernel's weight stage on the CPU (mega/stage.py): which instructions' rows go into a CTA's shared-memory
stage, which earlier instruction of the same queue starts each copy, the words that carry the plan in a row, and
the check that refuses a plan the kernel would misread (a copy nobody reads, two copies in flight, a produced
tensor, rows past the stage)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megadecode.cache import KVCache
from megadecode.mega import stage
from megadecode.mega.isa import F_TC, ROW, STAGE_BYTES, W_STAGE_ISSUE, W_STAGE_ROWS, Instr
from megadecode.mega.kernel_check import KernelLimit, check_program
from megadecode.mega.lower import lower
from megadecode.mega.schedule import schedule
from megadecode.presets import preset_config
from megadecode.weights import param_specs, random_weights


def _prog(preset: str, batch: int, ctas: int = 8):
    cfg = preset_config(preset)
    w = random_weights(cfg, "cpu", torch.bfloat16, 0)
    cache = KVCache(cfg, max(batch, 4), 64, "cpu", torch.bfloat16)
    return schedule(lower(cfg, w, cache, batch, ctas), ctas)


@pytest.mark.parametrize("preset", ("tiny-qwen3-moe", "tiny-deepseek-v3", "tiny-k3"))
def test_batch_1_rows_are_staged_once_each_by_an_earlier_instruction_of_their_queue(preset):
    prog = _prog(preset, 1)
    users = [i for i, ins in enumerate(prog.instrs) if ins.stage_rows > 0]
    assert users, "no batch-1 MATVEC / GLU staged"
    assert {prog.instrs[i].op for i in users} <= {"MATVEC", "GLU"}
    # every batch-1 CUDA-core MATVEC / GLU of static weights is a user (rows in the stage, up to its size)
    for ins in prog.instrs:
        if ins.op in ("MATVEC", "GLU"):
            assert ins.stage_rows == stage.user_rows(ins) > 0
    issued = {}
    for q in prog.queues:
        last_user = -1
        for pos, idx in enumerate(q):
            t = prog.instrs[idx].stage_issue
            if t >= 0:
                assert t not in issued
                issued[t] = idx
                # the issuer is the first instruction after the previous user: the earliest free moment
                assert pos == last_user + 1 and q.index(t) >= pos
            if prog.instrs[idx].stage_rows:
                last_user = pos
    assert sorted(issued) == users
    stage.check(prog)
    check_program(prog)


def test_no_stage_from_two_tokens():
    for preset in ("tiny-qwen3-moe", "tiny-k3"):
        prog = _prog(preset, 3)
        assert all(ins.stage_rows == 0 and ins.stage_issue == -1 for ins in prog.instrs)


def test_the_plan_travels_in_the_rows_last_two_words():
    prog = _prog("tiny-qwen3-moe", 1)
    rows = prog.rows()
    assert rows.shape[1] == ROW
    for i, ins in enumerate(prog.instrs):
        assert (int(rows[i, W_STAGE_ISSUE]), int(rows[i, W_STAGE_ROWS])) == (ins.stage_issue, ins.stage_rows)
        back = Instr.from_row(rows[i].tolist())
        assert (back.stage_issue, back.stage_rows, back.args) == (ins.stage_issue, ins.stage_rows, ins.args)


def test_user_rows_fill_the_stage_with_whole_row_pairs():
    def mv(rows, K, **kw):
        return Instr("MATVEC", 0, dict(w=0, K=K, r0=0, r1=rows, B=kw.get("B", 1)), flags=kw.get("flags", 0))

    row = lambda K: 2 * K  # noqa: E731  (bf16 bytes a row)
    assert STAGE_BYTES == 48 * 1024
    assert stage.user_rows(mv(20, 2048)) == STAGE_BYTES // row(2048) == 12  # qwen3-30b-a3b's q/k/v tiles
    assert stage.user_rows(mv(8, 4096)) == 6  # its o_proj tiles: 6 of 8 rows
    assert stage.user_rows(mv(8, 7168)) == 2  # 3 rows fit; pairs are staged whole
    assert stage.user_rows(mv(3, 1024)) == 3  # a whole tile, odd rows included
    assert stage.user_rows(mv(4, 32768)) == 0  # a row larger than the stage
    assert stage.user_rows(mv(8, 2048, B=2)) == 0 and stage.user_rows(mv(8, 2048, flags=F_TC)) == 0
    glu = Instr("GLU", 0, dict(wg=0, wu=1, K=2048, r0=0, r1=16, B=1))
    assert stage.user_rows(glu) == STAGE_BYTES // 2 // row(2048) == 6  # gate and up rows, half a stage each
    assert stage.user_rows(glu, static={0}) == 0  # the up rows are not a static weight: never staged


def test_qwen3_30b_a3b_at_true_dims_stages_most_of_its_batch_1_tiles():
    full = preset_config("qwen3-30b-a3b")
    cfg = dataclasses.replace(full, num_layers=2, moe_layers=full.moe_layers[:2])
    w = {n: torch.empty(s.shape, device="meta", dtype=torch.bfloat16) for n, s in param_specs(cfg).items()}
    cache = KVCache(cfg, 1, 64, "meta", torch.bfloat16)
    prog = schedule(lower(cfg, w, cache, 1, 264), 264)
    stage.check(prog)
    by = {}
    for ins in prog.instrs:
        if ins.stage_rows:
            name = ins.name.split(".")[1].split("[")[0]
            by.setdefault(name, set()).add((ins.args["r1"] - ins.args["r0"], ins.stage_rows))
    assert (20, 12) in by["q_proj"] and (8, 6) in by["o_proj"], by


def test_check_refuses_plans_the_kernel_would_misread():
    def broken(edit):
        prog = _prog("tiny-qwen3-moe", 1)
        edit(prog)
        return prog

    def first_user(prog):
        return next(i for i, ins in enumerate(prog.instrs) if ins.stage_rows)

    def drop_issue(prog):
        u = first_user(prog)
        next(ins for ins in prog.instrs if ins.stage_issue == u).stage_issue = -1

    def issue_twice(prog):  # the next user's copy started by a user, over its own rows before it read them
        q = next(q for q in prog.queues if sum(prog.instrs[i].stage_rows > 0 for i in q) >= 2)
        u0, u1 = [i for i in q if prog.instrs[i].stage_rows][:2]
        next(prog.instrs[i] for i in q if prog.instrs[i].stage_issue == u1).stage_issue = -1
        prog.instrs[u0].stage_issue = u1

    def too_many_rows(prog):
        prog.instrs[first_user(prog)].stage_rows += 2

    def produced(prog):
        ins = prog.instrs[first_user(prog)]
        prog.tensors[ins.args["w"]].role = "produced"

    for edit, match in ((drop_issue, "nobody copied"), (issue_twice, "still in the stage"),
                        (too_many_rows, "fit the stage"), (produced, "static weights")):
        with pytest.raises(KernelLimit, match=match):
            check_program(broken(edit))
