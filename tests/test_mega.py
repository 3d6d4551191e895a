"""The megakernel's instruction stream on the CPU: rows round-trip, lowering and scheduling of both families,
and pyvm (the golden model) against the torch executor, with its own checks shown to fire: a missing wait is a
race, a queue out of order deadlocks, a wait run early is refused."""

from __future__ import annotations

import pytest
import torch

from megadecode.cache import KVCache
from megadecode.engine import Engine
from megadecode.backends.mega.isa import (
    F_MXFP4,
    F_PAIR1,
    PAIR1_MAX_B,
    PASS,
    F_STAGE,
    F_TC,
    ROW,
    W_NEXT,
    W_STAGE,
    Instr,
    Wait,
    bits_f32,
    f32_bits,
    up_chunks,
    up_passes,
)
from megadecode.backends.mega.lower import Unsupported, lower
from megadecode.backends.mega.pyvm import DeadlockError, PyVM, WaitViolation
from megadecode.backends.mega.schedule import report, schedule
from megadecode.presets import preset_config
from megadecode.sampling import SamplingParams
from megadecode.weights import random_weights

FAMILIES = ("tiny-qwen3-moe", "tiny-deepseek-v3", "tiny-k3")


def _program(preset: str, batch: int, ctas: int = 8, seed: int = 0, sample=None):
    cfg = preset_config(preset)
    w = random_weights(cfg, "cpu", torch.float32, seed)
    cache = KVCache(cfg, max(batch, 4), 64, "cpu", torch.float32)
    return cfg, w, cache, schedule(lower(cfg, w, cache, batch, ctas, sample=sample), ctas)


def test_rows_round_trip_and_float_bits():
    ins = Instr("MERGE", 3, dict(part_off=1, out_off=2, out_stride=3, b=0, h=1, S=2, H=4, d=16, wuv=-1, dv=16, P=0,
                                 gate_off=-1),
                signal=7, waits=[Wait(5, 12, 12)], flags=2, name="x")
    row = ins.row()
    assert len(row) == ROW
    back = Instr.from_row(row)
    assert (back.op, back.layer, back.signal, back.flags, back.args) == ("MERGE", 3, 7, 2, ins.args)
    assert [(w.counter, w.need, w.per_launch) for w in back.waits] == [(5, 12, 12)]
    assert bits_f32(f32_bits(1e-6)) == pytest.approx(1e-6, rel=1e-7)
    with pytest.raises(ValueError, match="missing"):
        Instr("MERGE", 0, {"b": 0}).row()


def test_up_chunks_split_every_expert_pass_row_once_in_equal_shares():
    """EXPERT_UP's split: every (expert, pass, row) unit in exactly one item, items within one row of each other,
    whatever the pairs per expert (one hot expert with many passes, many with one)."""
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        n = int(torch.randint(1, 40, (1,), generator=g))
        passes = torch.randint(1, 5, (n,), generator=g).tolist()
        qst = [0]
        for p in passes:
            qst.append(qst[-1] + p)
        I = int(torch.randint(1, 70, (1,), generator=g))
        W = int(torch.randint(1, 300, (1,), generator=g))
        seen = torch.zeros(qst[-1] * I, dtype=torch.int32)
        sizes = []
        for w in range(W):
            size = 0
            for u, q, r0, r1 in up_chunks(qst, I, w, W):
                assert 0 <= q < passes[u] and 0 <= r0 < r1 <= I
                seen[(qst[u] + q) * I + r0:(qst[u] + q) * I + r1] += 1
                size += r1 - r0
            sizes.append(size)
        assert bool((seen == 1).all())
        assert max(sizes) - min(sizes) <= 1


def _pyvm_step_matches_torch(preset: str, batch: int, tol: float):
    """One fp32 decode step of `preset` at `batch` (prompts of 1 and 2 tokens) in pyvm, with its race checks, against
    the torch executor within relative tolerance `tol`; returns the config and the batch's machine."""
    cfg = preset_config(preset)
    w = random_weights(cfg, "cpu", torch.float32, 2)
    ref = Engine(cfg, w, executor="torch", max_batch=batch, max_seq_len=64)
    vm = Engine(cfg, w, executor="pyvm", max_batch=batch, max_seq_len=64)
    prompts = [[3 + i, 7][: 1 + i % 2] for i in range(batch)]
    tok = ref.prefill(prompts).argmax(-1)
    vm.prefill(prompts)
    vm.executor.check_races = True
    la, lb = ref.decode(tok), vm.decode(tok)
    assert ((la - lb).abs().max() / la.abs().max()).item() < tol
    return cfg, vm.executor.vm(batch)


def test_pyvm_experts_with_several_passes_match_torch():
    """Batch 16 on 8 experts with 2 picks each: 32 pairs, so some expert holds more than PASS pairs and EXPERT_UP
    walks several passes of it (split across items)."""
    _, machine = _pyvm_step_matches_torch("tiny-qwen3-moe", 16, 1e-5)
    # the last MoE layer's routing, as ROUTE left it: some expert has more pairs than one pass takes
    (off, _), n = machine.prog.i32["pstart"], int(machine.i32[machine.prog.i32["nuniq"][0]])
    pairs = machine.i32[off:off + n + 1].diff()
    assert int(pairs.max()) > PASS
    qoff = machine.prog.i32["qst"][0]
    assert machine.i32[qoff:qoff + n + 1].diff().tolist() == (-(-pairs // PASS)).tolist()


@pytest.mark.parametrize("preset,batch,flag,tol", [("tiny-k3", 16, F_MXFP4, 1e-4),
                                                    ("tiny-qwen3-moe", PAIR1_MAX_B, F_PAIR1, 1e-5)])
def test_pyvm_experts_take_one_pair_a_pass_and_match_torch(preset, batch, flag, tol):
    """K3's MXFP4 experts, and bf16 experts up to PAIR1_MAX_B tokens (F_PAIR1): EXPERT_UP's passes hold one
    (expert, token) pair each (isa.up_passes: the pass prefix is ROUTE's pair prefix), so an expert picked by
    several tokens is walked once per pair, and the step still matches torch. The batch leaves some expert with
    several pairs; one token more than PAIR1_MAX_B, bf16 experts take PASS pairs a pass again."""
    cfg, machine = _pyvm_step_matches_torch(preset, batch, tol)
    ups = [ins for ins in machine.prog.instrs if ins.op == "EXPERT_UP"]
    assert ups and all(ins.flags & flag and up_passes(ins.flags) == (1, "pstart_off") for ins in ups)
    (off, _), n = machine.prog.i32["pstart"], int(machine.i32[machine.prog.i32["nuniq"][0]])
    pstart = machine.i32[off:off + n + 1].tolist()
    assert max(b - a for a, b in zip(pstart, pstart[1:])) > 1
    # the last layer's items cover every (pair, row) unit once
    I, last = cfg.moe_intermediate_size, [ins for ins in ups if ins.layer == ups[-1].layer]
    seen = torch.zeros(pstart[-1] * I, dtype=torch.int32)
    for ins in last:
        for u, q, r0, r1 in up_chunks(pstart, I, ins.args["w"], ins.args["W"]):
            seen[(pstart[u] + q) * I + r0:(pstart[u] + q) * I + r1] += 1
    assert bool((seen == 1).all())
    assert up_passes(0) == (PASS, "qst_off")
    if flag == F_PAIR1:  # past PAIR1_MAX_B the bf16 passes hold up to PASS pairs
        w = random_weights(cfg, "cpu", torch.float32, 2)
        big = Engine(cfg, w, executor="pyvm", max_batch=batch + 1, max_seq_len=64).executor.vm(batch + 1)
        assert not any(ins.flags & F_PAIR1 for ins in big.prog.instrs if ins.op == "EXPERT_UP")


@pytest.mark.parametrize("preset", FAMILIES)
@pytest.mark.parametrize("batch", [1, 5])
def test_schedule_covers_every_instruction_once_in_phase_order(preset, batch):
    *_, prog = _program(preset, batch, ctas=6)
    flat = sorted(i for q in prog.queues for i in q)
    assert flat == list(range(len(prog.instrs)))
    for q in prog.queues:  # in-order queues only wait on earlier phases
        sig = [prog.instrs[i].signal for i in q]
        assert sig == sorted(sig)
    starts, order = prog.queue_table()
    assert starts[-1] == len(prog.instrs) and order.shape == (len(prog.instrs),)
    rows = prog.rows()  # each row names the next of its CTA's queue (the kernel's copy-ahead chain), -1 at the end
    for q in filter(None, prog.queues):
        assert [int(rows[i, W_NEXT]) for i in q] == q[1:] + [-1]
    text = report(prog)
    assert "predicted step" in text and "L0.attn" in text and "predicted HBM occupancy" in text
    from megadecode.backends.mega.schedule import occupancy
    from megadecode.hardware import HBM_READ_BPS

    assert occupancy(HBM_READ_BPS * 1e-6 * 10, 20.0) == pytest.approx(0.5) and occupancy(1e6, 0.0) == 0.0


def test_report_names_each_phases_most_instructions_on_one_cta_and_elides_the_middle_phases():
    """schedule.report's max/CTA column is the most instructions one CTA runs in the phase (counted here from the
    queues), and with `top` it shows the first and last `top` phases, the rest counted in one line."""
    *_, prog = _program("tiny-qwen3-moe", 1, ctas=3)
    by_phase: dict[int, list[int]] = {}
    for c, q in enumerate(prog.queues):
        for i in q:
            by_phase.setdefault(prog.instrs[i].signal, []).append(c)
    most = {sig: max(ctas.count(c) for c in set(ctas)) for sig, ctas in by_phase.items()}
    assert max(most.values()) > 1  # 3 CTAs: some phase puts two instructions on one
    rows = {ln.split()[0]: ln.split() for ln in report(prog, top=100).splitlines()[3:] if ln.split()[0] in
            prog.phases}
    assert len(rows) == len(most)
    for sig, m in most.items():
        assert int(rows[prog.phases[sig - 1]][2]) == m
    text = report(prog, top=2).splitlines()
    shown = [ln.split()[0] for ln in text[3:] if ln.split()[0] in prog.phases]
    order = [prog.phases[sig - 1] for sig in sorted(most)]
    assert shown == order[:2] + order[-2:] and f"... {len(order) - 4} phases ..." in text


@pytest.mark.parametrize("preset", FAMILIES)
@pytest.mark.parametrize("batch", [1, 3])
def test_rows_name_the_weight_rings_staged_instructions(preset, batch):
    """The rows the kernel's ring build runs flag the instructions whose weights its ring streams (F_STAGE: batch-1
    MATVEC of bf16 rows on the CUDA cores, whole rows in its static bytes; not the routed experts) and chain each
    queue's flagged ones (W_STAGE), which is all the ring's loader walks; nothing else is flagged, the other build's
    rows flag nothing, and the instructions themselves (what pyvm runs) are unchanged."""
    cfg = preset_config(preset)
    w = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in random_weights(cfg, "cpu",
                                                                                        torch.float32, 0).items()}
    cache = KVCache(cfg, max(batch, 4), 64, "cpu", torch.bfloat16)
    prog = schedule(lower(cfg, w, cache, batch, 7), 7)
    assert not (prog.rows()[:, 3] & F_STAGE).any()  # rows for the other build: none
    rows = prog.rows(ring=True)
    staged = {i for i in range(len(prog.instrs)) if int(rows[i, 3]) & F_STAGE}
    for i, ins in enumerate(prog.instrs):
        assert not ins.flags & F_STAGE
        if i in staged:
            a = ins.args
            assert ins.op == "MATVEC" and a["B"] == 1 and not ins.flags & F_TC
            assert ins.prefetch[1:] == (2 * a["r0"] * a["K"], 2 * (a["r1"] - a["r0"]) * a["K"])
            assert int(rows[i, 12]) * 16 == 2 * (a["r1"] - a["r0"]) * a["K"]
    assert (len(staged) > 0) == (batch == 1)
    if batch == 1:  # every batch-1 MATVEC of these presets is stageable
        assert staged == {i for i, ins in enumerate(prog.instrs) if ins.op == "MATVEC"}
    for q in prog.queues:
        for pos, i in enumerate(q):
            later = [j for j in q[pos + 1:] if j in staged]
            assert int(rows[i, W_STAGE]) == (later[0] if later else -1)
    fp32 = schedule(lower(cfg, random_weights(cfg, "cpu", torch.float32, 0), cache, batch, 7), 7).rows(ring=True)
    assert not (fp32[:, 3] & F_STAGE).any()  # fp32 rows (pyvm's exact programs): the kernel reads bf16 only


@pytest.mark.parametrize("preset", FAMILIES)
@pytest.mark.parametrize("batch", [1, 3])
def test_pyvm_decode_matches_torch(preset, batch):
    cfg = preset_config(preset)
    w = random_weights(cfg, "cpu", torch.float32, 1)
    ref = Engine(cfg, w, executor="torch", max_batch=batch, max_seq_len=64)
    vm = Engine(cfg, w, executor="pyvm", max_batch=batch, max_seq_len=64)
    vm.executor.check_races = True
    prompts = [[3 + i, 7, 11 + 2 * i][: 1 + i % 3] for i in range(batch)]
    tok = ref.prefill(prompts).argmax(-1)
    vm.prefill(prompts)
    for _ in range(3):
        la, lb = ref.decode(tok), vm.decode(tok)
        assert ((la - lb).abs().max() / la.abs().max()).item() < 1e-5
        tok = la.argmax(-1)
    # the caches the two executors wrote agree too (GQA keys/values, MLA latents)
    for name, parts in ref.cache.layers.items():
        for x, y in zip(parts, vm.cache.layers[name]):
            assert torch.allclose(x, y, rtol=1e-5, atol=1e-5), name


@pytest.mark.parametrize("preset", FAMILIES)
def test_pyvm_greedy_generation_equals_torch(preset):
    cfg = preset_config(preset)
    w = random_weights(cfg, "cpu", torch.float32, 2)
    prompts = [[1, 2, 3], [9, 8]]
    a = Engine(cfg, w, executor="torch", max_batch=2, max_seq_len=64).generate(prompts, 8, SamplingParams(greedy=True))
    b = Engine(cfg, w, executor="pyvm", max_batch=2, max_seq_len=64).generate(prompts, 8, SamplingParams(greedy=True))
    assert a.token_ids == b.token_ids


@pytest.mark.parametrize("preset", FAMILIES)
def test_interleavings_give_bitwise_identical_results(preset):
    """Any order the queues and waits allow computes the same bits (no instruction depends on another's timing)."""
    outs = []
    for order, seed in (("round_robin", 0), ("random", 1), ("random", 2)):
        cfg, w, cache, prog = _program(preset, 2, ctas=5, seed=3)
        vm = PyVM(prog)
        off, n = prog.i32["tokens"]
        vm.i32[off:off + n] = torch.tensor([5, 9], dtype=torch.int32)
        vm.i32[prog.i32["positions"][0]:][:2] = torch.tensor([0, 0], dtype=torch.int32)
        vm.i32[prog.i32["slots"][0]:][:2] = torch.tensor([0, 1], dtype=torch.int32)
        vm.launch(order, seed)
        outs.append(vm.f32.clone())
        assert not vm.races()
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def _loaded_vm(preset, batch=2, ctas=5):
    cfg, w, cache, prog = _program(preset, batch, ctas=ctas)
    vm = PyVM(prog)
    vm.i32[prog.i32["tokens"][0]:][:batch] = torch.arange(batch, dtype=torch.int32) + 3
    vm.i32[prog.i32["slots"][0]:][:batch] = torch.arange(batch, dtype=torch.int32)
    return prog, vm


def test_a_missing_wait_is_reported_as_a_race():
    prog, vm = _loaded_vm("tiny-qwen3-moe")
    for ins in prog.instrs:
        if ins.op == "MERGE" and ins.layer == 0:
            ins.waits = []  # merge no longer waits for the attention partials it reads
    vm.launch("round_robin")
    found = vm.races(limit=100000)
    assert any("merge" in f and "attn" in f for f in found), found[:5]


def test_a_queue_out_of_order_deadlocks():
    prog, vm = _loaded_vm("tiny-deepseek-v3", ctas=1)
    prog.queues[0].reverse()  # the lm_head first: it waits on a phase queued behind it on the same CTA
    with pytest.raises(DeadlockError, match="blocked"):
        vm.launch()


def test_a_wait_run_early_is_refused():
    prog, vm = _loaded_vm("tiny-qwen3-moe")
    vm.counters[0] = 1
    later = next(i for i, ins in enumerate(prog.instrs) if ins.op == "ATTN_GQA")
    with pytest.raises(WaitViolation):
        vm.execute(later, epoch=1)


def test_counters_wrap_around_int32():
    """Counters are never reset: launch e waits for (e - 1) * per_launch + need, compared with wrapping int32,
    so a long-running server's counters may overflow."""
    prog, vm = _loaded_vm("tiny-qwen3-moe")
    per = prog.per_launch()
    e0 = 2**31 // max(per) + 5  # counters pass 2^31 within these launches
    vm.counters = [e0 - 1] + [((e0 - 1) * n + 2**31) % 2**32 - 2**31 for n in per[1:]]
    ref = None
    for _ in range(3):
        vm.launch()
        out = vm.f32[prog.f32["logits"][0]:].clone()
        ref = out if ref is None else ref
        assert torch.isfinite(out).all()
    assert any(c < 0 for c in vm.counters[1:])  # some counter wrapped


def test_k3_without_attn_res_matches_torch():
    """kimi_k3 with AttnRes off (attn_res_block_size 0): the plain residual stream, the same lowering otherwise."""
    import copy

    from megadecode.config import config_from_hf
    from megadecode.presets import PRESETS

    d = copy.deepcopy(PRESETS["tiny-k3"])
    d["attn_res_block_size"] = 0
    cfg = config_from_hf(d)
    w = random_weights(cfg, "cpu", torch.float32, 4)
    ref = Engine(cfg, w, executor="torch", max_batch=2, max_seq_len=64)
    vm = Engine(cfg, w, executor="pyvm", max_batch=2, max_seq_len=64)
    vm.executor.check_races = True
    tok = ref.prefill([[1, 2, 3], [4, 5]]).argmax(-1)
    vm.prefill([[1, 2, 3], [4, 5]])
    for _ in range(3):
        la, lb = ref.decode(tok), vm.decode(tok)
        assert ((la - lb).abs().max() / la.abs().max()).item() < 1e-5
        tok = la.argmax(-1)


def test_unsupported_models_and_batches_are_refused():
    cfg = preset_config("tiny-kimi-linear")
    w = random_weights(cfg, "cpu", torch.float32, 0)
    with pytest.raises(Unsupported, match="kimi_linear"):
        lower(cfg, w, KVCache(cfg, 1, 8, "cpu", torch.float32), 1)
    cfg = preset_config("tiny-qwen3-moe")
    w = random_weights(cfg, "cpu", torch.float32, 0)
    with pytest.raises(Unsupported, match="batch 65"):
        lower(cfg, w, KVCache(cfg, 65, 8, "cpu", torch.float32), 65)


def test_sample_instructions_pick_greedy_tokens():
    cfg, w, cache, prog = _program("tiny-qwen3-moe", 2, sample="greedy")
    vm = PyVM(prog)
    vm.i32[prog.i32["tokens"][0]:][:2] = torch.tensor([4, 5], dtype=torch.int32)
    vm.i32[prog.i32["slots"][0]:][:2] = torch.tensor([0, 1], dtype=torch.int32)
    vm.launch()
    logits = vm.f32[prog.f32["logits"][0]:][:2 * cfg.vocab_size].view(2, -1)
    toks = vm.i32[prog.i32["sampled"][0]:][:2]
    assert toks.tolist() == logits.argmax(-1).tolist()
    lp = vm.f32[prog.f32["sampled_lp"][0]:][:2]
    assert torch.allclose(lp, torch.log_softmax(logits, -1).gather(1, toks.long()[:, None])[:, 0])


def test_validate_executor_pyvm_passes_and_mega_is_not_run_on_the_cpu(capsys, tmp_path):
    """The kernel's audit (every rule, each saying what it checked), the planted mistakes each caught by its rule,
    and generation; the report lists them."""
    from megadecode.cli import main

    assert main(["validate", "--executor", "pyvm", "--preset", "tiny-qwen3-moe", "--steps", "8",
                 "--report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "e2e tiny-qwen3-moe float32 vs torch: PASS" in out
    assert "audit PASS mega_kernel" in out
    for rule in ("signal-before-barrier", "timeout-unreported", "produced-read-uncovered", "nc-load-of-produced"):
        assert f"  {rule}: " in out, rule  # what the rule checked
    assert "plant PASS mega_kernel+nc_cache: expected caught by audit:nc-load-of-produced; nc-load-of-produced" in out
    assert "plant SKIP mega_kernel+skip_last_chunk" in out
    md = (tmp_path / "pyvm-executor.md").read_text()
    assert "**Verdict: PASS**" in md and "| mega_kernel+no_body_barrier | caught by audit:signal-before-barrier" in md
    assert "- timeout-unreported: 2 spin loops" in md
    if not torch.cuda.is_available():
        assert main(["validate", "--executor", "mega", "--preset", "tiny-qwen3-moe", "--steps", "8"]) == 1
        assert "SKIP generation" in capsys.readouterr().out


def test_compare_generation_takes_pyvm_as_the_reference():
    """The megakernel is validated against pyvm (its own math) in bf16: the lockstep runs with pyvm as the reference
    and the fp32 logprob-gap bound applies. Here the torch executor against pyvm on the CPU in fp32: every token the
    same, the logits within 1e-4 while they agree."""
    from megadecode.validate.e2e import compare_generation

    res = compare_generation(None, "tiny-k3", steps=8, dtype=torch.float32, executor="torch", reference="pyvm",
                             prompts=([256, 1, 2], [256, 7]))
    assert res["reference"] == "pyvm" and res["logprob_gap_tol"] == 1e-3
    assert res["status"] == "PASS" and res["divergences"] == [], res
    assert 0 < res["max_logit_diff_before_divergence"] < 1e-4, res


def _bf16_program(preset: str, batch: int):
    cfg = preset_config(preset)
    w = random_weights(cfg, "cpu", torch.bfloat16, 0)
    cache = KVCache(cfg, max(batch, 4), 64, "cpu", torch.bfloat16)
    return cfg, w, cache, lower(cfg, w, cache, batch, 8)


@pytest.mark.parametrize("preset", FAMILIES)
def test_kernel_check_passes_the_bf16_programs_of_every_family(preset):
    from megadecode.backends.mega.kernel_check import check_program

    *_, prog = _bf16_program(preset, 3)
    check_program(prog)
    if preset == "tiny-k3":
        mx = [i for i in prog.instrs if i.op in ("EXPERT_UP", "EXPERT_DOWN")]
        assert mx and all(i.flags & F_MXFP4 for i in mx)
        assert {"ATTN_RES", "KDA_STEP"} <= {i.op for i in prog.instrs}


def test_kernel_check_refuses_wrong_dtypes_lengths_and_alignment():
    from megadecode.backends.mega.kernel_check import KernelLimit, check_program

    cfg, w, cache, _ = _bf16_program("tiny-k3", 2)
    w32 = dict(w)
    w32["model.layers.0.self_attn.o_norm.weight"] = w32["model.layers.0.self_attn.o_norm.weight"].float()
    with pytest.raises(KernelLimit, match="onorm_w .*o_norm.weight.* is torch.float32; .* torch.bfloat16"):
        check_program(lower(cfg, w32, cache, 2, 8))
    cache32 = KVCache(cfg, 4, 64, "cpu", torch.float32)  # fp32 KV caches: the kernel reads them as bf16
    with pytest.raises(KernelLimit, match="cache"):
        check_program(lower(cfg, w, cache32, 2, 8))
    for op, change, match in (("MATVEC", {"K": 60}, "K = 60 is not a multiple of 8"),
                              ("EXPERT_UP", {"D": 48}, "D = 48 is not a multiple of 32"),  # 8 | 48, not a block
                              ("MATVEC", {"x_off": None}, r"x_off = \d+ is not a multiple of 4 fp32"),
                              ("KDA_STEP", {"K": 4096}, "KDA head dim 4096"),
                              ("ATTN_RES", {"D": 60}, "D = 60 is not a multiple of 8"),
                              ("ATTN_RES", {"src_off": None}, r"src_off = \d+ is not a multiple of 4 fp32"),
                              ("ROUTE", {"E": 1000}, "1000 experts"),
                              ("ROUTE", {"B": 512, "A": 16}, "512 x 16 .token, expert. pairs .ROUTE"),
                              ("MLA_ATTN", {"HB": 9}, "9 heads in one MLA attention instruction"),
                              ("EXPERT_DOWN", {"B": 64, "A": 32}, "64 x 32 .token, expert. pairs")):
        prog = lower(cfg, w, cache, 2, 8)
        ins = next(i for i in prog.instrs if i.op == op)
        ins.args.update({k: ins.args[k] + 2 if v is None else v for k, v in change.items()})  # None: misalign by 2
        with pytest.raises(KernelLimit, match=match):
            check_program(prog)


def test_k3_lowers_at_true_dims_and_batch_64_within_the_kernels_limits():
    """K3's 896 experts x top-16 at batch 64 (1024 pairs) lower and pass the kernel check, on meta tensors."""
    from megadecode.backends.mega.kernel_check import check_program
    from megadecode.weights import param_specs

    cfg = preset_config("k3-layer")
    w = {n: torch.empty(s.shape, device="meta", dtype=torch.uint8 if s.quant == "mxfp4" else
                        torch.float32 if s.fp32 else torch.bfloat16) for n, s in param_specs(cfg).items()}
    cache = KVCache(cfg, 64, 64, "meta", torch.bfloat16)
    prog = lower(cfg, w, cache, 64, 132)
    check_program(prog)
    route = next(i for i in prog.instrs if i.op == "ROUTE")
    assert (route.args["E"], route.args["A"], route.args["B"]) == (896, 16, 64)


def test_tc_input_is_the_input_times_the_norm_weight_as_two_bf16_within_2e_16():
    """isa.tc_input, the input F_TC's rows multiply: hi + lo, both bf16, hi the input times the norm weight rounded to
    bf16; within 2**-16 of the fp32 product relatively. Two inputs one fp32 step apart on the two sides of a bf16
    rounding boundary give hi a bf16 step apart but hi + lo within 2**-15 (one bf16 rounding alone differs by 2**-8)."""
    from megadecode.backends.mega.isa import tc_input

    x = torch.randn(3, 64) * 7
    g = torch.randn(64).to(torch.bfloat16)
    xg = x * g.float()
    t = tc_input(x, g)
    hi = xg.to(torch.bfloat16).float()
    assert torch.equal((t - hi).to(torch.bfloat16).float(), t - hi)  # lo is a bf16 value
    assert ((t - xg).abs() <= xg.abs() * 2.0 ** -16).all()
    assert not torch.equal(hi, xg) and not torch.equal(t, hi)  # lo carries what hi rounded away
    assert torch.equal(tc_input(x), tc_input(x, torch.ones(64, dtype=torch.bfloat16)))
    mid = torch.tensor([1.0 + 2.0 ** -8])  # halfway between the bf16 values 1 and 1 + 2**-7
    below, above = torch.nextafter(mid, torch.zeros(1)), torch.nextafter(mid, torch.full((1,), 2.0))
    assert below.to(torch.bfloat16).item() == 1.0 and above.to(torch.bfloat16).item() == 1.0 + 2.0 ** -7
    assert abs(tc_input(above) - tc_input(below)).item() <= 2.0 ** -15


@pytest.mark.parametrize("preset", FAMILIES)
def test_tensor_core_rows_flag_bf16_rows_from_two_tokens(preset):
    """Builder.tc: F_TC on the MATVEC / GLU of a bf16 program from batch 2 whose K is a multiple of TC_K (most of the
    tiny presets' rows, so mega_check's batches 3 and 16 run the tensor-core loop on the GPU), never at batch 1 or on
    fp32 rows."""
    from megadecode.backends.mega.isa import F_TC, TC_K

    for batch, want in ((1, False), (3, True), (16, True)):
        *_, prog = _bf16_program(preset, batch)
        rows = [i for i in prog.instrs if i.op in ("MATVEC", "GLU")]
        fit = [i for i in rows if i.args["K"] % TC_K == 0]  # tiny-k3's KDA gate projections have K = 16
        assert len(fit) > len(rows) // 2
        assert all(bool(i.flags & F_TC) == (want and i in fit) for i in rows), batch
    cfg = preset_config(preset)
    w = random_weights(cfg, "cpu", torch.float32, 0)
    prog = lower(cfg, w, KVCache(cfg, 4, 64, "cpu", torch.float32), 3, 8)
    assert not any(i.flags & F_TC for i in prog.instrs)


def test_pyvm_tensor_core_rows_take_the_input_as_two_bf16_and_stay_close_to_torch():
    """A bf16 tiny-qwen3 step at batch 3 in pyvm: under F_TC its rows multiply the input as bf16 pairs hi + lo
    (isa.tc_input), so its logits are those of the same program with F_TC cleared to 1e-4, and both stay within
    bf16 tolerance of torch's bf16 step."""
    from megadecode.backends.mega.isa import F_TC

    cfg = preset_config("tiny-qwen3-moe")
    w = random_weights(cfg, "cpu", torch.bfloat16, 3)
    batch = 3
    prompts = [[3 + i, 7] for i in range(batch)]
    ref = Engine(cfg, w, executor="torch", max_batch=batch, max_seq_len=64)
    tok = ref.prefill(prompts).argmax(-1)
    la = ref.decode(tok).float()
    out = []
    for clear in (False, True):
        vm = Engine(cfg, w, executor="pyvm", max_batch=batch, max_seq_len=64)
        vm.prefill(prompts)
        machine = vm.executor.vm(batch)
        tc = [i for i in machine.prog.instrs if i.flags & F_TC]
        assert tc
        if clear:
            for i in tc:
                i.flags &= ~F_TC
        out.append(vm.decode(tok).float())
    scale = la.abs().max()
    assert ((out[0] - la).abs().max() / scale).item() < 5e-2
    assert ((out[1] - la).abs().max() / scale).item() < 5e-2
    d = ((out[0] - out[1]).abs().max() / scale).item()
    assert d < 1e-4, d


def _pyvm_step_with_and_without(cfg, w, prompts, tok, turn_off) -> tuple[list, list]:
    """One pyvm decode step of `prompts` (race check on) as lowered now, then again after `turn_off()` (a
    monkeypatch that lowers without the change under test): the two steps' logits and their machines."""
    out, machines = [], []
    for on in (True, False):
        if not on:
            turn_off()
        vm = Engine(cfg, w, executor="pyvm", max_batch=len(prompts), max_seq_len=64)
        vm.executor.check_races = True
        vm.prefill(prompts)
        out.append(vm.decode(tok).float())
        machines.append(vm.executor.vm(len(prompts)))
    return out, machines


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-deepseek-v3"])
def test_grouped_bf16_experts_cover_every_pass_once_and_match_the_pass_loop(preset, monkeypatch):
    """bf16 experts from GROUP_MIN_B tokens (F_GROUP): EXPERT_UP's and EXPERT_DOWN's items share the (pass of up to
    GROUP_N pairs, 16-row tile) units of every selected expert, each unit once, EXPERT_DOWN pair-major with a
    COMBINE phase after it; pyvm's step then matches the same engine lowered without F_GROUP (the CUDA-core pass
    loop, the combine fused) to 1e-4, the input being tc_input's two bf16 there, and both stay near torch's."""
    from megadecode.backends.mega import layers
    from megadecode.backends.mega.isa import F_GROUP, GROUP_MIN_B, GROUP_N, GROUP_TILE, group_prefix

    cfg = preset_config(preset)
    w = random_weights(cfg, "cpu", torch.bfloat16, 3)
    batch = GROUP_MIN_B + 4  # off the power-of-two corner, some expert with more than GROUP_N pairs
    prompts = [[3 + i, 7] for i in range(batch)]
    ref = Engine(cfg, w, executor="torch", max_batch=batch, max_seq_len=64)
    tok = ref.prefill(prompts).argmax(-1)
    la = ref.decode(tok).float()
    out, machines = _pyvm_step_with_and_without(cfg, w, prompts, tok,
                                                lambda: monkeypatch.setattr(layers, "GROUP_MIN_B", 1 << 30))
    ops = [[i.op for i in m.prog.instrs if i.flags & F_GROUP] for m in machines]
    assert "EXPERT_UP" in ops[0] and "EXPERT_DOWN" in ops[0] and not ops[1]
    assert sum(i.op == "COMBINE" for i in machines[0].prog.instrs) > 0
    # the last MoE layer's routing: some expert holds more than one pass; every unit taken once by its items
    m = machines[0]
    (off, _), n = m.prog.i32["pstart"], int(m.i32[m.prog.i32["nuniq"][0]])
    pstart = m.i32[off:off + n + 1].tolist()
    pre = group_prefix(pstart)
    assert max(b - a for a, b in zip(pre, pre[1:])) > 1
    last = max(i.layer for i in m.prog.instrs if i.op == "EXPERT_UP")
    for op, rows in (("EXPERT_UP", cfg.moe_intermediate_size), ("EXPERT_DOWN", cfg.hidden_size)):
        items = [i for i in m.prog.instrs if i.op == op and i.layer == last]
        seen = torch.zeros(pre[-1] * rows, dtype=torch.int32)
        for ins in items:
            for u, q, r0, r1 in up_chunks(pre, rows, ins.args["w"], ins.args["W"], GROUP_TILE):
                assert r0 % GROUP_TILE == 0 and r1 % GROUP_TILE == 0
                seen[(pre[u] + q) * rows + r0:(pre[u] + q) * rows + r1] += 1
        assert bool((seen == 1).all()), op
    assert pre == [0] + torch.tensor([-(-(b - a) // GROUP_N) for a, b in zip(pstart, pstart[1:])]).cumsum(0).tolist()
    scale = la.abs().max()
    d = ((out[0] - out[1]).abs().max() / scale).item()
    assert d < 1e-4, d
    assert ((out[0] - la).abs().max() / scale).item() < 0.3  # bf16 torch at this batch (the pass loop's as far)
    assert ((out[1] - la).abs().max() / scale).item() < 0.3


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-deepseek-v3"])
def test_split_route_picks_on_several_ctas_then_one_table_give_the_same_step(preset, monkeypatch):
    """Past ROUTE_SPLIT_B tokens a MoE layer's ROUTE is a phase of F_PICKS instructions (ROUTE_TOKENS tokens each,
    every token once) and an F_TABLES instruction after it; pyvm's step (its race check on) then equals, bit for
    bit, the same engine lowered with one ROUTE (softmax scores, and sigmoid scores with groups and a bias)."""
    from megadecode.backends.mega import layers
    from megadecode.backends.mega.isa import F_PICKS, F_TABLES, ROUTE_SPLIT_B, ROUTE_TOKENS

    cfg = preset_config(preset)
    w = random_weights(cfg, "cpu", torch.bfloat16, 5)
    batch = 2 * ROUTE_TOKENS + 3  # a last instruction of 3 tokens
    assert batch > ROUTE_SPLIT_B
    prompts = [[5 + i, 2] for i in range(batch)]
    tok = Engine(cfg, w, executor="torch", max_batch=batch, max_seq_len=64).prefill(prompts).argmax(-1)
    out, machines = _pyvm_step_with_and_without(cfg, w, prompts, tok,
                                                lambda: monkeypatch.setattr(layers, "ROUTE_SPLIT_B", 1 << 30))
    routes = [[i for i in m.prog.instrs if i.op == "ROUTE"] for m in machines]
    moe = sorted({i.layer for i in routes[1]})
    assert moe and all(not i.flags & (F_PICKS | F_TABLES) for i in routes[1])
    for layer in moe:
        picks = [i for i in routes[0] if i.layer == layer and i.flags & F_PICKS]
        tables = [i for i in routes[0] if i.layer == layer and i.flags & F_TABLES]
        assert len(tables) == 1 and len(picks) == -(-batch // ROUTE_TOKENS)
        assert sorted(t for i in picks for t in range(i.args["t0"], i.args["t1"])) == list(range(batch))
        assert all(tables[0].waits[0].counter == i.signal for i in picks)  # the tables wait for every pick
    assert torch.equal(out[0], out[1])


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-deepseek-v3"])
def test_router_rows_in_token_chunks_give_the_same_step(preset, monkeypatch):
    """Past ROUTER_TOKENS tokens a MoE layer without shared experts runs the router's tiles once per chunk of the
    batch's tokens (each chunk's x, logits and normed rows at its first token; every (tile, token) once): pyvm's
    step, race check on, equals the whole-batch router's bit for bit. With shared experts (tiny-deepseek-v3) the
    router keeps the whole batch."""
    from megadecode.backends.mega import layers

    cfg = preset_config(preset)
    w = random_weights(cfg, "cpu", torch.bfloat16, 6)
    batch = 2 * layers.ROUTER_TOKENS + 3
    prompts = [[4 + i, 9] for i in range(batch)]
    tok = Engine(cfg, w, executor="torch", max_batch=batch, max_seq_len=64).prefill(prompts).argmax(-1)
    out, machines = _pyvm_step_with_and_without(cfg, w, prompts, tok,
                                                lambda: monkeypatch.setattr(layers, "ROUTER_TOKENS", 1 << 30))
    for m, chunked in zip(machines, (cfg.n_shared_experts == 0, False)):
        for layer in sorted({i.layer for i in m.prog.instrs if i.op == "ROUTE"}):
            router = [i for i in m.prog.instrs if i.op == "MATVEC" and i.layer == layer and ".router[" in i.name]
            cover = {}
            for i in router:
                t0 = (i.args["x_off"] - router[0].args["x_off"]) // i.args["x_stride"]
                assert i.args["out_off"] == router[0].args["out_off"] + t0 * i.args["out_stride"]
                for r in range(i.args["r0"], i.args["r1"]):
                    for t in range(t0, t0 + i.args["B"]):
                        cover[r, t] = cover.get((r, t), 0) + 1
            assert set(cover.values()) == {1} and len(cover) == cfg.num_experts * batch
            assert (len({i.args["B"] for i in router} - {batch}) > 0) == chunked
    assert torch.equal(out[0], out[1])


def test_split_route_instructions_are_refused_off_their_batch():
    """An F_PICKS token range outside the batch, or F_PICKS with F_TABLES, is refused before a launch."""
    from megadecode.backends.mega.isa import F_PICKS, F_TABLES
    from megadecode.backends.mega.ops import route

    def ins(flags, **a):
        return Instr(op="ROUTE", layer=0, flags=flags, args=dict(dict(E=8, A=2, B=12, t0=0, t1=8), **a))

    route.check(None, ins(F_PICKS), "x")
    route.check(None, ins(F_TABLES, t1=0), "x")
    for flags, args in ((F_PICKS, dict(t0=8, t1=8)), (F_PICKS, dict(t1=13)), (F_PICKS, dict(t0=-1)),
                        (F_PICKS | F_TABLES, {})):
        with pytest.raises(ValueError, match="F_PICKS"):
            route.check(None, ins(flags, **args), "x")


def test_grouped_experts_are_refused_where_the_kernel_cannot_take_them():
    """F_GROUP's limits, checked before a launch: bf16 pass-wise experts only, dims whole tiles and steps."""
    from megadecode.backends.mega.isa import F_GROUP, GROUP_MAX_E
    from megadecode.backends.mega.limits import KernelLimit
    from megadecode.backends.mega.ops.expert_up import check_group

    def ins(op, flags, **a):
        return Instr(op=op, layer=0, flags=flags, args=dict(dict(I=32, D=64, E=8), **a))

    check_group(ins("EXPERT_UP", F_GROUP), "x")
    for flags, args, what in ((F_GROUP | F_PAIR1, {}, "F_PAIR1"), (F_GROUP | F_MXFP4, {}, "F_MXFP4"),
                              (F_GROUP, dict(I=40), "multiples"), (F_GROUP, dict(D=48), "multiples"),
                              (F_GROUP, dict(E=GROUP_MAX_E + 1), "experts")):
        with pytest.raises(KernelLimit, match=what):
            check_group(ins("EXPERT_UP", flags, **args), "x")


def _bf16_cfg_program(cfg, batch: int, max_len: int, ctas: int = 16):
    """A config's bf16 program (random weights, a cache of max_len), scheduled on ctas CTAs."""
    w = random_weights(cfg, "cpu", torch.bfloat16, 0)
    return schedule(lower(cfg, w, KVCache(cfg, batch, max_len, "cpu", torch.bfloat16), batch, ctas), ctas)


def test_the_wide_mxfp4_case_lowers_to_rows_of_several_chunks():
    """mega_gpu.CASES' tiny-k3-wide (the GPU checks' MXFP4 rows longer than one 1024-weight chunk, neither a
    multiple of it): its config overrides tiny-k3's, and its program passes the kernel's pre-launch check."""
    from megadecode.backends.mega.kernel_check import check_program
    from megadecode.validate.mega_gpu import case_config

    cfg = case_config("tiny-k3-wide")
    assert (cfg.latent_size, cfg.moe_intermediate_size) == (1056, 2080)
    assert case_config("tiny-k3").latent_size == 32
    prog = _bf16_cfg_program(cfg, 3, 64)
    check_program(prog)
    ups = [i for i in prog.instrs if i.op == "EXPERT_UP"]
    assert ups and all(i.args["D"] == 1056 and i.args["I"] == 2080 for i in ups)


def test_the_gqa_case_has_qwen3s_attention_shape_and_wider_heads_are_refused_before_launch():
    """mega_gpu.CASES' tiny-qwen3-gqa: head_dim 128 and 16 q heads a KV head (the GQA body's full thread layout,
    cute/attention.py gqa_chunk), a program that passes the kernel's check; head_dim 256 or 32 q heads a KV head
    are refused by name before any launch (the body covers 128 dims and 16 heads)."""
    from megadecode.config import config_from_hf
    from megadecode.backends.mega.kernel_check import KernelLimit, check_program
    from megadecode.presets import preset_hf_config
    from megadecode.validate.mega_gpu import case_config

    cfg = case_config("tiny-qwen3-gqa")
    assert (cfg.head_dim, cfg.num_heads // cfg.num_kv_heads) == (128, 16)
    prog = _bf16_cfg_program(cfg, 2, 128)
    check_program(prog)
    attn = [i for i in prog.instrs if i.op == "ATTN_GQA"]
    assert attn and all(i.args["d"] == 128 and i.args["H"] == 32 and i.args["KH"] == 2 for i in attn)
    base = preset_hf_config("tiny-qwen3-moe")
    for over, msg in (({"head_dim": 256}, "head_dim 256"), ({"num_attention_heads": 64, "num_key_value_heads": 2,
                                                             "head_dim": 32}, "32 q heads")):
        with pytest.raises(KernelLimit, match=msg):
            check_program(_bf16_cfg_program(config_from_hf({**base, **over}), 2, 128))


def test_batch_1_qwen3_routes_inside_expert_up_with_the_route_phases_outputs():
    """isa.ROUTE_IN_UP_MAX_B: at batch 1 a qwen3-moe layer has no ROUTE phase; every EXPERT_UP item picks the experts
    from the router's logits (F_ROUTE) and item 0 writes ROUTE's outputs. In pyvm (random interleaving, the race
    check on) every buffer ends as with the ROUTE phase: the same picks, weights, tables, activations and cache,
    bit for bit; batch 2 keeps the phase."""
    from megadecode.backends.mega import layers
    from megadecode.backends.mega.isa import F_ROUTE

    cfg = preset_config("tiny-qwen3-moe")
    w = random_weights(cfg, "cpu", torch.float32, 3)
    progs = {}
    for limit in (1, 0):
        cache = KVCache(cfg, 4, 64, "cpu", torch.float32)
        torch.manual_seed(4)
        for parts in cache.layers.values():
            for t in parts:
                t.normal_()
        old, layers.ROUTE_IN_UP_MAX_B = layers.ROUTE_IN_UP_MAX_B, limit
        try:
            progs[limit] = schedule(lower(cfg, w, cache, 1, 6), 6)
        finally:
            layers.ROUTE_IN_UP_MAX_B = old
    fused, phase = progs[1], progs[0]
    ups = [i for i in fused.instrs if i.op == "EXPERT_UP"]
    assert not any(i.op == "ROUTE" for i in fused.instrs) and all(i.flags & F_ROUTE for i in ups)
    n_moe = sum(i.op == "ROUTE" for i in phase.instrs)  # a ROUTE a MoE layer
    assert n_moe == len({i.layer for i in ups}) >= 2
    assert len(fused.phases) == len(phase.phases) - n_moe
    vms = []
    for prog in (fused, phase):
        vm = PyVM(prog)
        vm.i32[prog.i32["tokens"][0]] = 5
        vm.i32[prog.i32["positions"][0]] = 20
        vm.launch("random", seed=2)
        assert not vm.races(limit=10)
        vms.append(vm)
    assert torch.equal(vms[0].f32, vms[1].f32) and torch.equal(vms[0].i32, vms[1].i32)
    assert int(vms[0].i32[fused.i32["nuniq"][0]]) == cfg.top_k  # the tables were written
    for a, b in zip(fused.tensors, phase.tensors):
        if a.role == "produced":
            assert torch.equal(a.tensor, b.tensor), a.name
    _, _, _, prog2 = _program("tiny-qwen3-moe", 2)
    assert any(i.op == "ROUTE" for i in prog2.instrs)
    assert not any(i.flags & F_ROUTE for i in prog2.instrs if i.op == "EXPERT_UP")


def test_route_inside_expert_up_is_refused_past_its_limits():
    """F_ROUTE's picks take a thread an expert and a lane a pick, for bf16 experts one pair a pass: more experts or
    picks, or passes of several pairs, are refused before a launch."""
    from megadecode.backends.mega.isa import F_ROUTE
    from megadecode.backends.mega.kernel_check import check_program
    from megadecode.backends.mega.limits import KernelLimit

    cfg = preset_config("tiny-qwen3-moe")
    w = random_weights(cfg, "cpu", torch.bfloat16, 0)
    cache = KVCache(cfg, 1, 64, "cpu", torch.bfloat16)
    check_program(lower(cfg, w, cache, 1, 8))
    for change, clear, match in (({"E": 300}, 0, "at most 256 experts"), ({"A": 33}, 0, "32 picks"),
                                 ({}, F_PAIR1, "bf16 experts one pair a pass")):
        prog = lower(cfg, w, cache, 1, 8)
        ins = next(i for i in prog.instrs if i.op == "EXPERT_UP")
        assert ins.flags & F_ROUTE
        ins.args.update(change)
        ins.flags &= ~clear
        with pytest.raises(KernelLimit, match=match):
            check_program(prog)


def test_the_ring_checks_every_staged_round_fits():
    """kernel_check.check_ring: the rounds the staged body cuts (Program.ring_rounds, as cute/dense.py cuts them)
    each read at most the ring's slots, for the row shapes the presets lower (K 2048 / 4096 / 7168, tiles of 3 to
    288 rows, odd ones included); an instruction staged past what the ring holds is refused by name."""
    from megadecode.backends.mega.kernel_check import KernelLimit, check_ring
    from megadecode.backends.mega.limits import RING_PAGE, RING_SLOTS
    from megadecode.backends.mega.program import Program, Tensor

    def prog_of(K, rows):
        ins = Instr("MATVEC", 0, dict(w=0, K=K, x_off=0, x_stride=K, out_off=0, out_stride=rows, out_col=0, r0=0,
                                      r1=rows, B=1, norm_w=-1, eps_bits=0, normed_off=-1, x2_off=-1, add0_off=-1,
                                      add1_off=-1), name=f"L0.w[0:{rows}]")
        ins.prefetch = (0, 0, 2 * rows * K)
        return Program(None, 1, [ins], [Tensor("w", torch.zeros(1, dtype=torch.bfloat16), "static")], {}, {}, 1)

    for K in (8, 2048, 4096, 7168):
        for rows in (3, 16, 17, 40, 288):
            p = prog_of(K, rows)
            assert p.stageable(p.instrs[0])
            rounds = p.ring_rounds(p.instrs[0])
            assert rounds[0][0] == 0 and rounds[-1][1] == (2 * rows * K - 1) // RING_PAGE
            assert all(z - a + 1 <= RING_SLOTS // 2 for a, z in rounds)
            check_ring(p)
    p = prog_of(4096, 16)
    p.stageable = lambda ins: True  # as if a pair of rows wider than the ring were staged
    p.instrs[0].args["K"] = RING_SLOTS * RING_PAGE // 2
    p.instrs[0].prefetch = (0, 0, 2 * 16 * p.instrs[0].args["K"])
    with pytest.raises(KernelLimit, match=r"L0\.w\[0:16\]: a round of its staged rows reads pages 0\.\.\d+, more"):
        check_ring(p)
