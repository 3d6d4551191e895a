"""K3's routed experts held in fragment order by the executor that reads them (backends/expert_layout.py): the
conversion in place both ways, what the engine accepts, and the fused executor's paths over fragment-ordered
experts (prefill, decode, decode in chunks) on the CPU with a torch stand-in for the CuTe kernel
(tests/frag_emulation.py) against the torch executor. On the GPU the real kernels: tests/test_cute_experts.py."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from interp import (  # noqa: E402, F401 (interpreter_env: an autouse fixture, imported to apply here)
    DEVICE, greedy_run, import_interpreted, interpreter_env, triton_gate,
)

import_interpreted("megadecode.validate.catalog")

from frag_emulation import with_emulated_cute  # noqa: E402
from megadecode import Engine  # noqa: E402
from megadecode.engine import RequestError, check_weights  # noqa: E402
from megadecode.backends import expert_layout as EL  # noqa: E402
from megadecode.backends.fused.kernels import linear as LIN  # noqa: E402
from megadecode.plan import build_plan  # noqa: E402
from megadecode.presets import preset_config  # noqa: E402
from megadecode.quant.mxfp4 import MXFP4Tensor  # noqa: E402
from megadecode.quant.mxfp4_frag import RECORD, frag_from_entries, relayout  # noqa: E402
from megadecode.weights import random_weights  # noqa: E402

TRITON_OK, needs_triton = triton_gate(LIN.linear_kernel)
CFG = preset_config("tiny-k3-wide")


def _weights(dtype=torch.float32):
    return random_weights(CFG, "cpu", dtype, seed=5)


def test_take_converts_in_place_both_ways_and_frees_the_other_order():
    w = _weights()
    plan = build_plan(CFG)
    pairs = EL.expert_pairs(plan)
    assert len(pairs) == 2 * sum(op.kind == "latent_moe" for op in plan.ops) > 0
    before = {n: w[n].clone() for pair in pairs for n in pair}
    gone = weakref.ref(w[pairs[0][0]])
    assert EL.order_of(w, plan) == EL.CHECKPOINT
    own = EL.take(w, plan, EL.FRAGMENT)
    gc.collect()
    assert gone() is None  # the checkpoint-order tensor is freed: one copy of the experts' bytes
    assert own is not w and EL.order_of(w, plan) == EL.order_of(own, plan) == EL.FRAGMENT
    p, s = pairs[0]
    E, R, K2 = before[p].shape
    assert tuple(w[p].shape) == (E, R // 16, 2 * K2 // 256, RECORD) and tuple(w[s].shape) == (E, R, 0)
    assert w[p] is own[p]
    assert torch.equal(frag_from_entries(w[p], w[s]).data, relayout(MXFP4Tensor(before[p], before[s])).data)
    check_weights(CFG, w)  # the engine takes either order
    EL.take(w, plan, EL.FRAGMENT)  # already so: nothing converted
    assert w[p] is own[p]
    back = EL.take(w, plan, EL.CHECKPOINT)
    for n, t in before.items():
        assert torch.equal(back[n], t) and torch.equal(w[n], t), n
    assert own[p].dim() == 4  # the first executor's dict keeps its order (its tensors stay alive with it)


def test_mixed_orders_and_bad_entries_are_refused():
    w = _weights()
    plan = build_plan(CFG)
    (p, s), (p2, s2) = EL.expert_pairs(plan)[:2]
    f = relayout(MXFP4Tensor(w[p], w[s]))
    w[p], w[s] = f.data, f.data.new_empty((f.shape[0], f.shape[1], 0))
    with pytest.raises(ValueError, match="partly in fragment order"):
        EL.order_of(w, plan)
    with pytest.raises(ValueError, match="fragment order"):
        MXFP4Tensor(w[p], w[s])  # a checkpoint-order path handed records: named, not a shape error deep inside
    with pytest.raises(ValueError, match="not a fragment-ordered"):
        frag_from_entries(w[p], w[s2])
    bad = dict(w)
    bad[p] = f.data[:, :-1]
    with pytest.raises(RequestError, match="shape"):
        check_weights(CFG, bad)
    with pytest.raises(ValueError, match="order must be"):
        EL.take(w, plan, "nibbles")


@needs_triton
@pytest.mark.skipif(DEVICE != "cpu",
                    reason="the stand-in replaces the CuTe kernel: CPU only (the GPU runs the real one)")
def test_fused_over_fragment_order_matches_torch(monkeypatch):
    """Prefill (chunked: MAX_CHUNK 2), decode per variant, decode in chunks, then a torch engine on the same dict
    (the experts turned back): tokens equal, logits within 1e-4."""
    from megadecode.backends.fused.kernels import cute_experts as ce

    with_emulated_cute(monkeypatch)
    monkeypatch.setattr(ce, "MAX_CHUNK", 2)
    w = _weights()
    prompts = [[1, 5, 9], [2], [3, 6]]
    e, tok_f, log_f = greedy_run(CFG, w, "fused", prompts, 2, max_seq_len=24)
    assert e.executor.frag_experts and EL.order_of(w, e.executor.plan) == EL.FRAGMENT
    assert e.executor.chosen[("latent_moe", 3)] == "cute-latent-moe (in chunks of 256 tokens)"
    _, tok_t, log_t = greedy_run(CFG, w, "torch", prompts, 2, max_seq_len=24)
    assert EL.order_of(w, e.executor.plan) == EL.CHECKPOINT
    assert torch.equal(tok_f, tok_t)
    err = (log_f - log_t).abs().max().item()
    assert err <= 1e-4 * log_t.abs().max().item(), err


def _cute_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("cutlass")


@pytest.mark.gpu
@pytest.mark.parametrize("T", [3, 40])
def test_expert_shards_sum_to_the_whole_on_the_gpu(T):
    """Expert parallelism's arithmetic with the CuTe experts, on one GPU: each rank's records (a slice of the
    experts), the router's ids made local (-1 for the other rank's pairs), and the two fp32 partial sums added
    equal the whole within fp32 rounding (per pair at 3 tokens, grouped at 40)."""
    _cute_gpu()
    from megadecode.backends.fused.kernels.cute_experts import cute_experts
    from megadecode.parallel.experts import ExpertShard
    from megadecode.quant.mxfp4_frag import MXFP4Frag, relayout_experts

    E, D, I, A = 32, 512, 256, 4
    g = torch.Generator(device="cuda").manual_seed(T)

    def mx(rows, k):
        return MXFP4Tensor(torch.randint(0, 256, (E, rows, k // 2), device="cuda", dtype=torch.uint8, generator=g),
                           torch.randint(118, 124, (E, rows, k // 32), device="cuda", dtype=torch.uint8, generator=g))

    gu, dn = relayout_experts(mx(2 * I, D)), relayout_experts(mx(D, I))
    x = torch.randn(T, D, device="cuda", generator=g)
    ids = torch.stack([torch.randperm(E, device="cuda", generator=g)[:A] for _ in range(T)])
    w = torch.rand(T, A, device="cuda", generator=g)
    whole = cute_experts(x, ids, w, gu, dn, act="situ")
    total = torch.zeros_like(whole)
    for rank in range(2):
        sh = ExpertShard(E, 2, rank)

        def part(f):
            return MXFP4Frag(f.data[sh.lo:sh.hi].contiguous(), torch.Size((sh.hi - sh.lo, *f.shape[1:])))

        out = torch.full_like(whole, float("nan"))
        cute_experts(x, sh.local_ids(ids), w, part(gu), part(dn), act="situ", out=out)
        assert torch.isfinite(out).all()
        total += out
    assert float((total - whole).abs().max()) <= 1e-5 * float(whole.abs().max())


def _row_err(a, b):
    """Per row: max |a - b| over the row / max |b| of the row."""
    return (a - b).abs().amax(-1) / b.abs().amax(-1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_reads_fragment_order_on_the_gpu(dtype):
    """tiny-k3-wide through the fused executor on the GPU: the experts re-laid out in place (the caller's dict
    too), prefill and decode by the CuTe experts, a decode step of 300 sequences in chunks of 256, against the
    torch executor built after it on the same dict (the experts turned back). fp32: the remainder plane keeps ~22
    bits of the activations, the logits within 1e-3 of their largest. bf16: two bf16 computations differ by
    bf16 steps, enough to flip a later layer's experts on near ties (at 41aad87 on the H200, 17 of 300 rows were
    off by more than 3%, up to 2.95 of 3.98), so both bf16 runs are measured against the torch executor in fp32 on
    the same (bf16-valued) weights, and the fused one must be no further from it than about the torch one is: mean
    row error within 2x + 2e-3 of torch's, rows off by more than 3% within 2x + 3% of torch's."""
    _cute_gpu()
    w = random_weights(CFG, "cuda", dtype, seed=5)
    w32 = {k: v.float() if v.is_floating_point() else v for k, v in w.items()}  # its MXFP4 tensors are w's
    plan = build_plan(CFG)

    def logits(engine, prompts, toks=None):
        out = [engine.prefill(prompts).float()]
        out.append(engine.decode(out[0].argmax(-1) if toks is None else toks).float())
        return out

    for n, prompts in ((3, [[1, 5, 9], [2], [3, 6]]), (300, [[1 + i % 200, 7] for i in range(300)])):
        fused = Engine(CFG, w, executor="fused", max_batch=n, max_seq_len=16)
        assert fused.executor.frag_experts and EL.order_of(w, plan) == EL.FRAGMENT
        lf = logits(fused, prompts)
        toks = lf[0].argmax(-1)
        want = "cute-latent-moe" if n <= 256 else "cute-latent-moe (in chunks of 256 tokens)"
        assert fused.executor.chosen[("latent_moe", n)] == want
        del fused
        lt = logits(Engine(CFG, w, executor="torch", max_batch=n, max_seq_len=16), prompts, toks)
        assert EL.order_of(w, plan) == EL.CHECKPOINT
        if dtype == torch.float32:
            for a, b in zip(lf, lt):
                assert torch.isfinite(a).all()
                assert float((a - b).abs().max()) <= 1e-3 * float(b.abs().max()), n
            continue
        l32 = logits(Engine(CFG, w32, executor="torch", max_batch=n, max_seq_len=16), prompts, toks)
        for a, b, ref in zip(lf, lt, l32):
            assert torch.isfinite(a).all()
            ef, et = _row_err(a, ref), _row_err(b, ref)
            assert float(ef.mean()) <= 2 * float(et.mean()) + 2e-3, (n, float(ef.mean()), float(et.mean()))
            off_f, off_t = float((ef > 0.03).float().mean()), float((et > 0.03).float().mean())
            assert off_f <= 2 * off_t + 0.03, (n, off_f, off_t)


def test_conversion_memory_is_counted_before_the_build(monkeypatch):
    """The fused executor's re-layout needs a stack in its new order plus a chunk's scratch beside the weights:
    conversion_bytes (k3-mini: 13.3 GB; the H200 measured a peak 13.2 GB over the steady 72.2 GB at 41aad87), which
    Engine.from_pretrained adds to its fit check when the fused executor will make one."""
    from megadecode.backends import EXECUTORS
    from megadecode import memory
    from megadecode.backends.fused import executor as FE

    cfg = preset_config("k3-mini")
    E, R, K = cfg.num_experts, 2 * cfg.moe_intermediate_size, cfg.latent_size
    assert EL.conversion_bytes(cfg) == E * R * (K // 2 + K // 32) + 8 * R * K * 16
    assert EL.conversion_bytes(preset_config("qwen3-30b-a3b")) == 0
    assert EXECUTORS["graph"].build_extra(cfg, "cuda", torch.bfloat16, None) is None
    assert EXECUTORS["fused"].build_extra(cfg, "cpu", torch.bfloat16, None) is None
    monkeypatch.setattr(FE, "expert_order", lambda *a, **k: EL.FRAGMENT)
    more, why = EXECUTORS["fused"].build_extra(cfg, "cuda", torch.bfloat16, None)
    assert more == EL.conversion_bytes(cfg) and "re-lays out" in why
    monkeypatch.setattr(memory, "available_bytes", lambda d: 80e9)
    memory.check_fits("k3-mini", cfg, "cuda", torch.bfloat16, 1, 1024)  # ~72 GB of weights fit alone
    with pytest.raises(memory.InsufficientMemory, match=r"\+ 13\.30 GB while the fused executor re-lays out"):
        memory.check_fits("k3-mini", cfg, "cuda", torch.bfloat16, 1, 1024, extra=(more, why))
