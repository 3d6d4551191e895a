"""K3's routed experts in fragment order in the megakernel's instruction stream (F_FRAG: EXPERT_UP / EXPERT_DOWN on
the tensor cores, backends/mega/cute/moe.py), on the CPU: which order the mega executor holds them in, the lowering's
tile-aligned shares, the kernel check's limits, and pyvm on a fragment-order program against the same program in
the checkpoint's order (the kernel itself is diffed against pyvm on the GPU: tests/test_mega_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from megadecode.backends import expert_layout
from megadecode.backends.mega.executor import frag_order
from megadecode.backends.mega.isa import F_FRAG, F_MXFP4, F_SHARED, F_STORE, FRAG_DOWN, FRAG_TILE, up_chunks
from megadecode.backends.mega.kernel_check import KernelLimit, check_program
from megadecode.backends.mega.lower import lower
from megadecode.backends.mega.pyvm import PyVM
from megadecode.backends.mega.schedule import schedule
from megadecode.cache import KVCache
from megadecode.plan import build_plan
from megadecode.presets import preset_config
from megadecode.validate.mega_gpu import case_config
from megadecode.weights import random_weights


def test_mega_holds_k3_experts_in_fragment_order_on_a_gpu_where_the_widths_are_whole_records():
    assert frag_order(preset_config("k3-mini"), "cuda") == expert_layout.FRAGMENT
    assert frag_order(case_config("tiny-k3-frag"), "cuda") == expert_layout.FRAGMENT
    assert frag_order(preset_config("k3-mini"), "cpu") == expert_layout.CHECKPOINT
    assert frag_order(preset_config("tiny-k3"), "cuda") == expert_layout.CHECKPOINT  # widths of 32
    assert frag_order(case_config("tiny-k3-wide"), "cuda") == expert_layout.CHECKPOINT  # 1056, 2080
    assert frag_order(preset_config("tiny-qwen3-moe"), "cuda") == expert_layout.CHECKPOINT


def test_up_chunks_in_tile_units_split_every_pass_tile_once_in_equal_shares():
    g = torch.Generator().manual_seed(1)
    for _ in range(100):
        n = int(torch.randint(1, 30, (1,), generator=g))
        pre = [0]
        for _ in range(n):
            pre.append(pre[-1] + int(torch.randint(1, 4, (1,), generator=g)))
        I = FRAG_TILE * int(torch.randint(1, 12, (1,), generator=g))
        W = int(torch.randint(1, 200, (1,), generator=g))
        seen = torch.zeros(pre[-1] * I, dtype=torch.int32)
        sizes = []
        for w in range(W):
            size = 0
            for u, q, r0, r1 in up_chunks(pre, I, w, W, FRAG_TILE):
                assert r0 % FRAG_TILE == 0 and r1 % FRAG_TILE == 0 and 0 <= r0 < r1 <= I
                seen[(pre[u] + q) * I + r0:(pre[u] + q) * I + r1] += 1
                size += r1 - r0
            sizes.append(size)
        assert bool((seen == 1).all())
        assert max(sizes) - min(sizes) <= FRAG_TILE


def _programs(batch: int, dtype, ctas: int = 8):
    """tiny-k3-frag lowered twice on the same weights: experts in the checkpoint's order, and in fragment order."""
    cfg = case_config("tiny-k3-frag")
    w = random_weights(cfg, "cpu", dtype, 3)
    wf = expert_layout.take(dict(w), build_plan(cfg), expert_layout.FRAGMENT)
    progs = [schedule(lower(cfg, ws, KVCache(cfg, max(batch, 4), 64, "cpu", dtype), batch, ctas), ctas)
             for ws in (w, wf)]  # a cache each (a launch writes its cache and KDA states)
    return cfg, *progs


@pytest.mark.parametrize("batch", [1, 3])
def test_pyvm_runs_a_fragment_order_program_as_the_checkpoint_order_one(batch):
    """The same step through pyvm from both programs: F_FRAG on every expert instruction of the fragment-order one,
    none on the other, the same buffers (pyvm restores the records exactly; only the items' shares differ)."""
    cfg, ck, fr = _programs(batch, torch.float32)
    experts = [i for i in fr.instrs if i.op in ("EXPERT_UP", "EXPERT_DOWN")]
    assert experts and all(i.flags & F_FRAG and i.flags & F_MXFP4 for i in experts)
    assert not any(i.flags & F_FRAG for i in ck.instrs)
    downs = [i for i in experts if i.op == "EXPERT_DOWN"]
    assert not any(i.op == "COMBINE" for i in ck.instrs)  # the checkpoint order's EXPERT_DOWN sums itself
    g = torch.Generator().manual_seed(batch)
    vms = []
    for prog in (ck, fr):
        vm = PyVM(prog)
        for name, t in (("tokens", torch.randint(3, 200, (batch,), generator=torch.Generator().manual_seed(7))),
                        ("positions", torch.arange(batch) % 5), ("slots", torch.arange(batch))):
            off, n = prog.i32[name]
            vm.i32[off:off + n] = t.to(torch.int32)
        vm.launch("round_robin", seed=int(torch.randint(0, 100, (1,), generator=g)))
        vms.append(vm)
    for name in ("h", "y", "z", "logits"):
        (o1, n1), (o2, n2) = ck.f32[name], fr.f32[name]
        a, b = vms[0].f32[o1:o1 + n1], vms[1].f32[o2:o2 + n2]
        assert torch.isfinite(b).all() and b.abs().max() > 0
        assert ((a - b).abs().max() / a.abs().max()).item() < 1e-5, name
    ups = [i for i in experts if i.op == "EXPERT_UP" and i.layer == experts[-1].layer]
    (off, _), n = fr.i32["pstart"], int(vms[1].i32[fr.i32["nuniq"][0]])
    pstart = vms[1].i32[off:off + n + 1].tolist()
    I = cfg.moe_intermediate_size
    seen = torch.zeros(pstart[-1] * I, dtype=torch.int32)  # the last layer's items cover every (pair, tile) once
    for ins in ups:
        for u, q, r0, r1 in up_chunks(pstart, I, ins.args["w"], ins.args["W"], FRAG_TILE):
            seen[(pstart[u] + q) * I + r0:(pstart[u] + q) * I + r1] += 1
    assert bool((seen == 1).all())
    # EXPERT_DOWN's pair-major items cover every (pair, 32-row unit) once, and the COMBINE phase after them every
    # latent row once, waiting on the whole EXPERT_DOWN phase
    D = cfg.latent_size
    last = [i for i in downs if i.layer == experts[-1].layer]
    seen = torch.zeros(pstart[-1] * D, dtype=torch.int32)
    for ins in last:
        assert ins.flags & (F_STORE | F_SHARED) == 0
        for u, q, r0, r1 in up_chunks(pstart, D, ins.args["w"], ins.args["W"], FRAG_DOWN):
            assert r0 % FRAG_DOWN == 0 and r1 % FRAG_DOWN == 0
            seen[(pstart[u] + q) * D + r0:(pstart[u] + q) * D + r1] += 1
    assert bool((seen == 1).all())
    combines = [i for i in fr.instrs if i.op == "COMBINE" and i.layer == experts[-1].layer]
    rows = torch.zeros(D, dtype=torch.int32)
    for ins in combines:
        assert ins.flags & F_STORE and ins.waits[0].counter == last[0].signal and ins.waits[0].need == len(last)
        rows[ins.args["r0"]:ins.args["r1"]] += 1
    assert bool((rows == 1).all())


def test_kernel_check_passes_fragment_order_programs_and_refuses_what_the_bodies_cannot_take():
    _, _, fr = _programs(2, torch.bfloat16)
    check_program(fr)
    for op, change, match in (("EXPERT_DOWN", {"D": 512 - FRAG_TILE}, "output width 496 is not a whole number of 32-row"),
                              ("EXPERT_UP", {"I": 760}, "fragment-order experts need records"),
                              ("EXPERT_UP", {"D": 12288}, r"reduction width 12288 \(EXPERT_UP stages"),
                              ("EXPERT_DOWN", {"I": 512}, "fragment-order experts need records"),
                              ("EXPERT_UP", {"flags": F_FRAG},
                               "is torch.uint8; the megakernel reads it as torch.bfloat16")):
        _, _, prog = _programs(2, torch.bfloat16)
        ins = next(i for i in prog.instrs if i.op == op)
        if "flags" in change:
            ins.flags = change["flags"]
        else:
            ins.args.update(change)
        if op == "EXPERT_DOWN" and "D" in change:  # records for the narrower output, so that only its width is off
            t = prog.tensors[ins.args["dn"]]
            t.tensor = t.tensor[:, :change["D"] // FRAG_TILE]
        with pytest.raises(KernelLimit, match=match):
            check_program(prog)


def test_the_prefill_reads_fragment_order_experts_as_the_reference_reads_the_checkpoints(monkeypatch):
    """The mega executor's prefill (restored_latent_moe: each selected expert restored when the reference's loop
    reaches it) gives the torch reference's LatentMoE output bitwise, on 5 tokens whose picks repeat experts, and
    never restores more than one expert at a time (the whole selection at once ran the H200 out of memory)."""
    from megadecode.backends.mega.executor import restored_latent_moe
    from megadecode.quant import mxfp4_frag

    restored = []
    real = mxfp4_frag.restore
    monkeypatch.setattr(mxfp4_frag, "restore", lambda f: (restored.append(f.data.shape[0]), real(f))[1])
    from megadecode.backends.torch.ops import OP_IMPLS, StepContext
    from megadecode.plan import LATENT_MOE
    from megadecode.step import Step

    cfg = case_config("tiny-k3-frag")
    w = random_weights(cfg, "cpu", torch.float32, 5)
    wf = expert_layout.take(dict(w), build_plan(cfg), expert_layout.FRAGMENT)
    op = next(o for o in build_plan(cfg).ops if o.kind == LATENT_MOE)
    g = torch.Generator().manual_seed(0)
    buf = {"normed": torch.randn(5, cfg.hidden_size, generator=g),
           "topk_ids": torch.randint(0, cfg.num_experts, (5, cfg.top_k), generator=g),
           "topk_weights": torch.rand(5, cfg.top_k, generator=g)}
    step = Step(tokens=torch.zeros(5, dtype=torch.long), positions=torch.arange(5),
                slots=torch.zeros(5, dtype=torch.long), logit_rows=torch.tensor([4]), kv_len=5, segments=[(0, 5, 0)])
    outs = []
    for weights, run in ((w, OP_IMPLS[LATENT_MOE]), (wf, restored_latent_moe)):
        ctx = StepContext(cfg, weights, None, step)
        ctx.buf.update({k: v.clone() for k, v in buf.items()})
        run(ctx, op)
        assert ctx.w is weights and torch.equal(ctx.buf["topk_ids"], buf["topk_ids"])  # given back as they were
        outs.append(ctx.buf[op.outputs[0]])
    assert outs[0].abs().max() > 0 and torch.equal(outs[0], outs[1])
    assert restored and set(restored) == {1}  # gate_up and down of each selected expert, one expert a call


@pytest.mark.parametrize("batch", [1, 8, 64])
def test_k3_at_true_dims_lowers_fragment_order_experts_within_the_kernels_limits(batch):
    """K3's 896 experts in fragment order, on meta tensors (the shapes the mega executor holds): the expert
    instructions carry F_FRAG, pass the kernel check, and EXPERT_UP's items are the fewest that give no warp more
    units than the balanced share over every CTA's warps (B x A x I / 16 units; batches 1 and 8: the same whole
    number a warp in every item)."""
    from megadecode.quant.mxfp4_frag import entry_shape
    from megadecode.weights import param_specs

    cfg = preset_config("k3-layer")
    w = {n: torch.empty(entry_shape(n, p.shape) if p.quant == "mxfp4" and p.stacked else p.shape, device="meta",
                        dtype=torch.uint8 if p.quant == "mxfp4" else torch.float32 if p.fp32 else torch.bfloat16)
         for n, p in param_specs(cfg).items()}
    prog = lower(cfg, w, KVCache(cfg, batch, 64, "meta", torch.bfloat16), batch, 264)
    check_program(prog)
    ups = [i for i in prog.instrs if i.op == "EXPERT_UP"]
    downs = [i for i in prog.instrs if i.op == "EXPERT_DOWN"]
    assert ups and downs and all(i.flags & F_FRAG for i in ups + downs)
    units = batch * cfg.top_k * cfg.moe_intermediate_size // FRAG_TILE
    W = ups[0].args["W"]
    per_warp = -(-units // (8 * 264))
    assert len(ups) == W <= 264
    assert -(-units // W) <= 8 * per_warp  # no warp above the balanced share
    assert W == 1 or -(-units // (W - 1)) > 8 * per_warp  # and one item fewer would put one above it
    if batch in (1, 8):
        assert units % W == 0 and (units // W) % 8 == 0
    dunits = batch * cfg.top_k * cfg.latent_size // FRAG_DOWN  # EXPERT_DOWN's pair-major items, sized alike
    Wd = downs[0].args["W"]
    assert len(downs) == Wd <= 264 and -(-dunits // Wd) <= 8 * -(-dunits // (8 * 264))


def test_phase_rows_tiles_a_shared_phase_into_at_most_one_instruction_a_cta_in_proportion_to_bytes():
    """Builder.phase_rows: every op at least one tile, all rows covered, no more instructions than CTAs (or ops),
    and each op's count near its byte share where the CTAs allow (at most its share plus one an op, at least half
    of it: a tile's rows rounded up lose a few instructions); random parts and CTA counts."""
    from types import SimpleNamespace

    from megadecode.backends.mega.builder import Builder

    g = torch.Generator().manual_seed(5)
    for _ in range(300):
        ctas = int(torch.randint(1, 300, (1,), generator=g))
        parts = [(int(torch.randint(1, 20000, (1,), generator=g)), int(torch.randint(1, 30000, (1,), generator=g)))
                 for _ in range(int(torch.randint(1, 5, (1,), generator=g)))]
        rows = Builder.phase_rows(SimpleNamespace(ctas=ctas), parts)
        counts = [-(-n // r) for (n, _), r in zip(parts, rows)]
        assert all(1 <= r <= n for (n, _), r in zip(parts, rows))
        assert sum(counts) <= max(ctas, len(parts))
        total = sum(n * rb for n, rb in parts)
        if ctas >= 4 * len(parts):
            for (n, rb), c in zip(parts, counts):
                share = ctas * n * rb / total
                assert c <= max(1, share + len(parts)) and c >= min(n, share) / 2 - 1, (ctas, parts, counts)


def test_qkv_phase_makes_at_most_one_instruction_a_cta():
    """layers.qkv_rows: q, k and v tiled jointly make no more instructions than CTAs in their phase (qwen3-30b-a3b's
    heads on 132 and 264 CTAs, other head counts, tiny CTA counts), where one rows-per-tile for the three (the former
    tiling) made 134 on 132 at qwen3-30b-a3b batch 1."""
    from megadecode.backends.mega import layers
    from megadecode.backends.mega.builder import Builder

    class Tiler:
        phase_rows = Builder.phase_rows
        rows_per_tile = Builder.rows_per_tile

        def __init__(self, ctas: int):
            self.ctas = ctas

    for H, KH, d, ctas in ((32, 4, 128, 132), (32, 4, 128, 264), (64, 4, 128, 132), (40, 8, 128, 132),
                           (16, 2, 64, 7), (4, 2, 16, 5), (4, 2, 16, 16), (28, 4, 128, 100)):
        t = Tiler(ctas)
        sizes = (H * d, KH * d, KH * d)
        rows = layers.qkv_rows(t, H, KH, d)
        assert all(1 <= r <= n for n, r in zip(sizes, rows))
        assert sum(-(-n // r) for n, r in zip(sizes, rows)) <= max(ctas, 3), (H, KH, d, ctas, rows)
    shared = Tiler(132).rows_per_tile(5120)
    assert sum(-(-n // shared) for n in (4096, 512, 512)) == 134  # the former tiling, for the record
