"""The megakernel in CuTe DSL: one persistent launch walks a decode step's instruction queues (backends/mega/isa.py).

Each CTA (NT threads) runs its queue in order. For every instruction: thread 0 spins on the counters it waits on
(`wait_counter`: `ld.acquire.gpu`, bounded: on a timeout it records the instruction, counter and value in `err`,
sets the abort flag that every spinner also polls, and the launch drains), then a block barrier; the opcode's
body; a block barrier (`order_body_stores`); thread 0 signals (`signal`: `fence.acq_rel.gpu`, then
`atom.add.release.gpu`). Activations produced inside the launch (the fp32 and int32 arenas) and the tensors it
writes (caches, recurrent states: their addresses in `ptab`) are read with plain coherent `ld.global` after the
acquire; static weights (addresses in `wtab`) take the same plain loads in this version, and may take the
non-coherent path, which the static audit proves per load site reads only wtab's tensors (backends/mega/spec.py,
validate/audit.py). Opcode semantics: backends/mega/pyvm.py, which this kernel is diffed against.

Weights and caches are bf16 (routed experts bf16 or MXFP4; KDA's recurrent state fp32); activations fp32. Dot
products: each warp takes rows, each lane 8 consecutive elements at a time (16-byte loads), TB tokens per pass, fp32
accumulation, shuffle reductions. What the bodies assume of a program (dtypes, multiples of 8, alignment, shared
memory) is checked on the host before a launch (`backends/mega/kernel_check.py`).
"""

from __future__ import annotations

import functools
import tempfile

import cuda.bindings.driver as cuda_drv  # noqa: E402
import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import Float32, Int32, Int64, Uint32  # noqa: E402
from cutlass.memory import SmemAllocator  # noqa: E402

from .cute import ARCH  # noqa: F401  (sets CUTE_DSL_ARCH before cutlass is imported)
from .cute.attention import op_attn_gqa, op_mla_attn, op_mla_kv, op_mla_q  # noqa: E402
from .cute.base import (  # noqa: E402,F401
    NT,
    NW,
    RING_BYTES,
    RING_S,
    ROW,
    ROW_S,
    SMEM_BYTES,
    SMEM_F,
    SMEM_I,
    TL_S,
    TLW,
    bulk_copy,
    expect_tx,
    hash32,
    slot_wait,
)
from .cute.dense import op_embed, op_merge, op_rows, op_sample  # noqa: E402
from .cute.k3 import op_attn_res, op_kda_step  # noqa: E402
from .cute.moe import op_expert_down, op_expert_up, op_route  # noqa: E402
from .isa import OPCODES, SLOT_BYTES, SLOTS, W_STAGE  # noqa: E402


@cute.jit
def op_matvec(pb: Int64, idx: Int32, fb: Int64, ib: Int64, wtab: cute.Tensor, ptab: cute.Tensor, sm: cute.Tensor,
              smi: cute.Tensor, tid: Int32):
    op_rows(pb, idx, fb, ib, wtab, ptab, sm, smi, tid, False)


@cute.jit
def op_glu(pb: Int64, idx: Int32, fb: Int64, ib: Int64, wtab: cute.Tensor, ptab: cute.Tensor, sm: cute.Tensor,
           smi: cute.Tensor, tid: Int32):
    op_rows(pb, idx, fb, ib, wtab, ptab, sm, smi, tid, True)


# Each opcode's body (the same arguments for all); the persistent loop dispatches on the row's opcode.
BODIES = (("MATVEC", op_matvec), ("GLU", op_glu), ("EMBED", op_embed), ("ATTN_GQA", op_attn_gqa),
          ("MERGE", op_merge), ("ROUTE", op_route), ("EXPERT_UP", op_expert_up), ("EXPERT_DOWN", op_expert_down),
          ("SAMPLE", op_sample), ("MLA_KV", op_mla_kv), ("MLA_Q", op_mla_q), ("MLA_ATTN", op_mla_attn),
          ("ATTN_RES", op_attn_res), ("KDA_STEP", op_kda_step))


# ---- the persistent loop ------------------------------------------------------------------------------------
# The synchronisation steps are module-level functions, looked up when the kernel is traced, so that the harness's
# planted mistakes (validate/mega_plants.py) can swap one of them in a build of their own; the shipped kernel
# never changes.


@cute.jit
def wait_load(p) -> Int32:
    """One poll of a counter: an acquire load, so the data its producers released is visible after it."""
    return cute.arch.load(p, Int32, sem="acquire", scope="gpu")


@cute.jit
def wait_counter(ctr: cute.Tensor, err: cute.Tensor, c_idx: Int32, need: Int32, per: Int32, epoch: Int32,
                 max_spin: Int32, instr: Int32) -> Int32:
    """Thread 0: spin (acquire) until counter c_idx reached this launch's target; 1 when it did. After max_spin polls,
    or once another wait has aborted the launch, 0: the first to time out records the instruction, the counter,
    the value seen and the target in err and raises err[0], the abort flag every spinner polls, so the launch
    drains instead of hanging and the host raises MegaError (runtime.MegaRuntime.check)."""
    ok = Int32(1)
    if c_idx >= 0:
        target = (epoch - 1) * per + need
        p = (ctr.iterator + c_idx).llvm_ptr
        v = wait_load(p)
        spins = Int32(0)
        aborted = Int32(0)
        while (v - target) < 0 and spins < max_spin and aborted == 0:
            v = wait_load(p)
            aborted = cute.arch.load(err.iterator.llvm_ptr, Int32, sem="relaxed", scope="gpu")
            spins += 1
        if (v - target) < 0:
            ok = Int32(0)
            if aborted == 0:
                old = cute.arch.atomic_cas(err.iterator.llvm_ptr, cmp=Int32(0), val=Int32(1), sem="relaxed", scope="gpu")
                if old == 0:
                    err[1] = instr
                    err[2] = c_idx
                    err[3] = v
                    err[4] = target
    return ok


@cute.jit
def report_slot_timeout(err: cute.Tensor, instr: Int32, serial: Int32):
    """A slot whose copies did not land within the bound: reported like a counter's timeout, counter -2 (the ring)
    and the staged serial as the value seen; the launch drains."""
    old = cute.arch.atomic_cas(err.iterator.llvm_ptr, cmp=Int32(0), val=Int32(1), sem="relaxed", scope="gpu")
    if old == 0:
        err[1] = instr
        err[2] = Int32(-2)
        err[3] = serial
        err[4] = Int32(0)


@cute.jit
def order_body_stores():
    """Between an instruction's body and its signal: a block barrier, so every thread's stores are done before
    thread 0's fence and release publish them."""
    cute.arch.sync_threads()


@cute.jit
def signal(ctr: cute.Tensor, sig: Int32):
    """Thread 0, after order_body_stores: a gpu-scope fence, then the release add that consumers acquire."""
    cute.arch.fence_acq_rel_gpu()
    cute.arch.atomic_add((ctr.iterator + sig).llvm_ptr, Int32(1), sem="release", scope="gpu")


ISSUER = 64  # the thread that issues the ring's copies (warp 2's first lane: warp 1 fetches the row, thread 0 waits)


@cute.jit
def ring_issue(prog: cute.Tensor, wtab: cute.Tensor, ptab: cute.Tensor, smi: cute.Tensor, ring0: Int32, mbar0: Int32,
               tl: cute.Tensor, timeline: Int32):
    """The issuer: while fewer than SLOTS staged instructions are ahead of those its CTA finished, start the copy of
    the chain's next one (isa.Instr.stage: static bytes only, kernel_check) into slot (its serial) % SLOTS. That
    slot's previous user finished before the block barrier that ended it, which every thread passed before this
    runs; the proxy fence orders those generic reads before the copy engine's writes. No counter is waited on:
    weights do not change during a launch, so only the static table's tensors are staged (never ptab's)."""
    done = smi[RING_S]
    issued = smi[RING_S + 1]
    nxt = smi[RING_S + 2]
    while issued < done + SLOTS and nxt >= 0:
        slot = issued % SLOTS
        dst = ring0 + slot * SLOT_BYTES
        mb = mbar0 + slot * 8
        t, t2 = prog[nxt, W_STAGE], prog[nxt, W_STAGE + 1]
        off = Int64(prog[nxt, W_STAGE + 2]) * 16
        n = prog[nxt, W_STAGE + 3] * 16
        tot = n
        if t2 >= 0:
            tot = 2 * n
        if (timeline & 1) != 0:
            tl[TLW * nxt + 8] = cute.arch.globaltimer()
        cute.arch.fence_proxy("async.shared", space="cta")
        expect_tx(mb, tot)
        bulk_copy(dst, wtab[t] + off, n, mb)
        if t2 >= 0:
            bulk_copy(dst + n, wtab[t2] + off, n, mb)
        issued += 1
        nxt = prog[nxt, W_STAGE + 4]
    smi[RING_S + 1] = issued
    smi[RING_S + 2] = nxt


@cute.jit
def ring_wait(smi: cute.Tensor, mbar0: Int32, max_spin: Int32) -> Int32:
    """Wait, bounded, for the current staged instruction's slot (serial smi[RING_S]): 1 once its copies landed."""
    done = smi[RING_S]
    return slot_wait(mbar0 + (done % SLOTS) * 8, (done // SLOTS) & 1, max_spin)


@cute.jit
def nap(max_ns: Int32, a: Int32, b: Int32, c: Int32):
    """Sleep a pseudo-random 0..max_ns ns (the debug build's delays that shake out ordering bugs)."""
    ns = hash32(Uint32(a), Uint32(b), Uint32(c)) % Uint32(max_ns)
    cute.arch.inline_ptx("nanosleep.u32 {$r0};", read_only_args=[Int32(ns)])


@cute.kernel
def mega_kernel(prog: cute.Tensor, qstart: cute.Tensor, qorder: cute.Tensor, ctr: cute.Tensor, f32: cute.Tensor,
                i32: cute.Tensor, wtab: cute.Tensor, ptab: cute.Tensor, err: cute.Tensor, max_spin: Int32,
                tl: cute.Tensor, timeline: Int32, delay_ns: Int32):
    """`wtab`: the device address of every static tensor of the program's tensor table (weights; 0 for the others),
    `ptab`: of every tensor written in the launch (caches, states; 0 for the others), one index space: a body reads
    a weight's address from wtab and a cache's from ptab, so the audit can tell, per load, what it reads
    (backends/mega/spec.py). `timeline` bit 0: thread 0 records per instruction [wait start, work start, end (globaltimer
    ns), SM, and up to 4 marks its body stamps (base.mark)] in tl, TLW words each. `delay_ns` > 0 (the debug
    build): thread 0 sleeps a random 0..delay_ns after its wait and after its signal, and every warp sleeps its own
    random 0..delay_ns before the body, so that warps store at different times and a signal that does not wait for
    all of them would be seen early."""
    tid, _, _ = cute.arch.thread_idx()
    bid, _, _ = cute.arch.block_idx()
    alloc = SmemAllocator()
    sm = alloc.allocate_tensor(Float32, cute.make_layout(SMEM_F), 16)
    smi = alloc.allocate_tensor(Int32, cute.make_layout(SMEM_I), 16)
    ring = alloc.allocate_tensor(Int32, cute.make_layout(RING_BYTES // 4), 128)  # SLOTS slots of staged weights
    mbar = alloc.allocate_tensor(Int64, cute.make_layout(SLOTS), 8)  # a slot's copies complete on its mbarrier
    ring0 = ring.iterator.toint()
    mbar0 = mbar.iterator.toint()
    pb = prog.iterator.toint()
    fb = f32.iterator.toint()
    ib = i32.iterator.toint()
    # the launch number (written before the launch): read with acquire like every other read of the counters
    epoch = cute.arch.load(ctr.iterator.llvm_ptr, Int32, sem="acquire", scope="gpu")
    if tid == 0:  # where base.mark stamps (timeline builds; 0: no marks); read after the first instruction's barrier
        tla = Int64(0)
        if (timeline & 1) != 0:
            tla = tl.iterator.toint()
        smi[TL_S] = Int32(tla & Int64(0xFFFFFFFF))
        smi[TL_S + 1] = Int32(tla >> Int64(32))
        for k in cutlass.range_constexpr(SLOTS):
            cute.arch.mbarrier_init(mbar.iterator + k, 1)
        cute.arch.mbarrier_init_fence()
        smi[RING_S] = Int32(0)
    qs, qe = qstart[bid], qstart[bid + 1]
    if tid == ISSUER:  # the head of the stage chain: the queue's first staged instruction
        head = Int32(-1)
        q = qs
        while head < 0 and q < qe:
            if prog[qorder[q], W_STAGE] >= 0:
                head = qorder[q]
            q += 1
        smi[RING_S + 1] = Int32(0)
        smi[RING_S + 2] = head
    cute.arch.sync_threads()  # the mbarriers and the ring's words before any copy or wait
    for qi in cutlass.range(qs, qe):
        idx = qorder[qi]
        if tid >= 32 and tid < 32 + ROW:  # warp 1 fetches the row while thread 0 waits
            smi[ROW_S + tid - 32] = prog[idx, tid - 32]
        if tid == ISSUER:  # and the issuer starts the copies the ring has room for, ahead of the waits
            if delay_ns > 0:
                nap(delay_ns, idx, epoch, bid * 4)
            ring_issue(prog, wtab, ptab, smi, ring0, mbar0, tl, timeline)
        t_wait = Int64(0)
        if tid == 0:
            t_wait = cute.arch.globaltimer()
            ok = wait_counter(ctr, err, prog[idx, 4], prog[idx, 5], prog[idx, 6], epoch, max_spin, idx)
            if ok == 1:
                ok = wait_counter(ctr, err, prog[idx, 7], prog[idx, 8], prog[idx, 9], epoch, max_spin, idx)
            slot = Int32(-1)
            landed = Int32(1)
            if prog[idx, W_STAGE] >= 0:  # a staged instruction: its slot's copies landed (bounded, reported; also
                # after a counter's timeout, so that no copy is in flight when the launch drains)
                slot = ring0 + (smi[RING_S] % SLOTS) * SLOT_BYTES
                landed = ring_wait(smi, mbar0, max_spin)
                if landed == 0:
                    report_slot_timeout(err, idx, smi[RING_S])
                if (timeline & 1) != 0:
                    tl[TLW * idx + 9] = cute.arch.globaltimer()
            smi[RING_S + 3] = slot
            smi[SMEM_I - 1] = ok * landed
            cute.arch.fence_acq_rel_gpu()
            if delay_ns > 0:
                nap(delay_ns, idx, epoch, bid * 4 + 1)
        cute.arch.sync_threads()
        t_start = Int64(0)
        if tid == 0:
            t_start = cute.arch.globaltimer()
        if smi[SMEM_I - 1] == 1:
            if smi[RING_S + 3] >= 0 and tid != 0:  # every reader of the slot observes its copies' completion
                ring_wait(smi, mbar0, max_spin)  # (thread 0 saw it: returns at once)
            if delay_ns > 0:  # each warp its own delay before any of its stores
                nap(delay_ns, idx, epoch, (bid * NW + tid // 32) * 4 + 3)
            op = prog[idx, 0]
            for k in cutlass.range_constexpr(len(BODIES)):
                if op == OPCODES[BODIES[k][0]]:
                    BODIES[k][1](pb, idx, fb, ib, wtab, ptab, sm, smi, tid)
            order_body_stores()
            sig = prog[idx, 2]
            if tid == 0 and sig >= 0:
                signal(ctr, sig)
        if tid == 0:
            if prog[idx, W_STAGE] >= 0:  # its slot is free for the issuer once every thread passes the barrier below
                smi[RING_S] = smi[RING_S] + 1
            if (timeline & 1) != 0:
                tl[TLW * idx] = t_wait
                tl[TLW * idx + 1] = t_start
                tl[TLW * idx + 2] = cute.arch.globaltimer()
                tl[TLW * idx + 3] = Int64(cute.arch.smid())
            if delay_ns > 0:
                nap(delay_ns, idx, epoch, bid * 4 + 2)
        cute.arch.sync_threads()


@cute.jit
def launch(prog: cute.Tensor, qstart: cute.Tensor, qorder: cute.Tensor, ctr: cute.Tensor, f32: cute.Tensor,
           i32: cute.Tensor, wtab: cute.Tensor, ptab: cute.Tensor, err: cute.Tensor, max_spin: Int32, tl: cute.Tensor,
           timeline: Int32, delay_ns: Int32, num_ctas: Int32, stream: cuda_drv.CUstream):
    mega_kernel(prog, qstart, qorder, ctr, f32, i32, wtab, ptab, err, max_spin, tl, timeline, delay_ns).launch(
        grid=(num_ctas, 1, 1), block=(NT, 1, 1), stream=stream)


def current_stream_arg():
    """The current torch CUDA stream as the launcher's stream argument (so a step can be graph-captured)."""
    import torch

    return cuda_drv.CUstream(torch.cuda.current_stream().cuda_stream)


def fake_args():
    """The launcher's arguments as placeholders (no GPU needed): what a compile for the audit is traced with."""
    from cutlass.cute.runtime import make_fake_compact_tensor as fk

    return (fk(Int32, (64, ROW)), fk(Int32, (9,)), fk(Int32, (64,)), fk(Int32, (64,)),
            fk(Float32, (4096,), assumed_align=16), fk(Int32, (1024,), assumed_align=16), fk(Int64, (16,)),
            fk(Int64, (16,)), fk(Int32, (8,)), Int32(1 << 20), fk(Int64, (256,)), Int32(0), Int32(0), Int32(8),
            cuda_drv.CUstream(0))


def compile_ptx_cubin():
    """cute.compile the launcher with placeholder tensors, no GPU needed, keeping the PTX (`.__ptx__`, what the
    static audit and the occupancy calculation read; the dump goes to a temporary directory) and the DSL's cubin
    (`.artifacts.CUBIN`). Uncached: `compile_for` is the cached form."""
    dump = tempfile.mkdtemp(prefix="megadecode-cute-")
    return cute.compile(launch, *fake_args(), options=f"--gpu-arch={ARCH} --keep-ptx --keep-cubin --dump-dir={dump}",
                        no_cache=True)


@functools.lru_cache(maxsize=1)
def compile_for():
    """The shipped kernel compiled for the audit, once per process (~100 s on a 2-core CPU)."""
    return compile_ptx_cubin()
