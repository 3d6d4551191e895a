"""The megakernel in CuTe DSL: one persistent launch walks a decode step's instruction queues (backends/mega/isa.py).

Each CTA (NT threads) runs its queue in order. For every instruction: thread 0 spins on the counters it waits on
(`wait_counter`: `ld.acquire.gpu`, bounded: on a timeout it records the instruction, counter and value in `err`,
sets the abort flag that every spinner also polls, and the launch drains), then a block barrier; the opcode's
body; a block barrier (`order_body_stores`); thread 0 signals (`signal`: `atom.add.release.gpu`). The wait's
acquire and the block barrier after it make the producers' stores visible to every thread (CUTLASS's grid barrier
waits the same way), and the next instruction's row is copied into shared memory while this one runs (its
index is the row's last word, isa.W_NEXT). Activations produced inside the launch (the fp32 and int32 arenas)
and the tensors it writes (caches, recurrent states: their addresses in `ptab`) are read with plain coherent
`ld.global` after the acquire; static weights (addresses in `wtab`) take the same plain loads in this version, and may take the
non-coherent path, which the static audit proves per load site reads only wtab's tensors (backends/mega/spec.py,
validate/audit.py). Opcode semantics: backends/mega/pyvm.py, which this kernel is diffed against.

Weights and caches are bf16 (routed experts bf16 or MXFP4; KDA's recurrent state fp32); activations fp32. Dot
products: each warp takes rows, each lane 8 consecutive elements at a time (16-byte loads), TB tokens per pass, fp32
accumulation, shuffle reductions. What the bodies assume of a program (dtypes, multiples of 8, alignment, shared
memory) is checked on the host before a launch (`backends/mega/kernel_check.py`).
"""

from __future__ import annotations

import functools
import importlib
import tempfile

import cuda.bindings.driver as cuda_drv  # noqa: E402
import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import Float32, Int32, Int64, Uint32  # noqa: E402
from cutlass.memory import SmemAllocator  # noqa: E402

from .cute import ARCH  # noqa: F401  (sets CUTE_DSL_ARCH before cutlass is imported)
from .cute.base import (  # noqa: E402,F401
    IDX_S, LOADER, NEXT_S, NT, NTL, NW, RING_BYTES, RING_S, RING_SLOTS, ROW, ROW_S, SMEM_BYTES, SMEM_F, SMEM_I,
    SMEM_RING_BYTES, TL_S, TLW, block_smem, block_threads, cta_sync, free_pages, hash32, loader, nap, ring_init,
    ring_pages, row_copies_landed, row_copy16, staged_pages,
)
from . import ops  # noqa: E402
from .isa import F_STAGE, OPCODES, W_NEXT, W_STAGE  # noqa: E402


# Each opcode's body (the same arguments for all); the persistent loop dispatches on the row's opcode.
DISPATCH = ("MATVEC", "GLU", "EMBED", "ATTN_GQA", "MERGE", "ROUTE", "EXPERT_UP", "EXPERT_DOWN", "COMBINE", "SAMPLE",
            "MLA_KV", "MLA_Q", "MLA_ATTN", "ATTN_RES", "KDA_STEP")  # the order the loop tests the opcode in
BODIES = tuple((n, getattr(importlib.import_module(f".cute.{ops.BY_NAME[n].OP.body[0]}", __package__),
                           ops.BY_NAME[n].OP.body[1])) for n in DISPATCH)


# ---- the persistent loop ------------------------------------------------------------------------------------
# The synchronisation steps are module-level functions, looked up when the kernel is traced, so that the harness's
# planted mistakes (validate/mega_plants.py) can swap one of them in a build of their own; the shipped kernel
# never changes.


@cute.jit
def wait_load(p) -> Int32:
    """One poll of a counter: an acquire load, so the data its producers released is visible after it."""
    return cute.arch.load(p, Int32, sem="acquire", scope="gpu")


# The wait polls the launch's abort flag (err[0]) once every ABORT_POLL polls of its counter, not every poll: the flag
# is one word that every spinning CTA reads, and 130-260 spinners polling it without pause queue at its L2 slice in
# front of the loads of the instructions that run (qwen3-30b-a3b batch 1 on the H200, bench/mega_sync_ab.py: launch
# median 4248 against 4335 us). A timeout elsewhere is seen at most ABORT_POLL polls later.
ABORT_POLL = 32


@cute.jit
def record_timeout(err: cute.Tensor, instr: Int32, c_idx: Int32, v: Int32, target: Int32):
    """A wait that timed out: the first raises err[0], the abort flag, and records the instruction, the counter, the
    value seen and the target (the host's MegaError names them); later ones leave the record as it is."""
    old = cute.arch.atomic_cas(err.iterator.llvm_ptr, cmp=Int32(0), val=Int32(1), sem="relaxed", scope="gpu")
    if old == 0:
        err[1] = instr
        err[2] = c_idx
        err[3] = v
        err[4] = target


@cute.jit
def wait_counter(ctr: cute.Tensor, err: cute.Tensor, c_idx: Int32, need: Int32, per: Int32, epoch: Int32,
                 max_spin: Int32, instr: Int32) -> Int32:
    """Thread 0: spin (acquire) until counter c_idx reached this launch's target; 1 when it did. After max_spin polls,
    or once another wait has aborted the launch (err[0], read every ABORT_POLL polls), 0: the first to time out
    records itself (record_timeout), so the launch drains instead of hanging and the host raises MegaError
    (runtime.MegaRuntime.check)."""
    ok = Int32(1)
    if c_idx >= 0:
        target = (epoch - 1) * per + need
        p = (ctr.iterator + c_idx).llvm_ptr
        v = wait_load(p)
        spins = Int32(0)
        aborted = Int32(0)
        while (v - target) < 0 and spins < max_spin and aborted == 0:
            v = wait_load(p)
            if spins % ABORT_POLL == ABORT_POLL - 1:
                aborted = cute.arch.load(err.iterator.llvm_ptr, Int32, sem="relaxed", scope="gpu")
            spins += 1
        if (v - target) < 0:
            ok = Int32(0)
            if aborted == 0:
                record_timeout(err, instr, c_idx, v, target)
    return ok


@cute.jit
def order_body_stores():
    """Between an instruction's body and its signal: a block barrier (of the compute warps, base.cta_sync), so every
    thread's stores are done before thread 0's release publishes them."""
    cta_sync()


@cute.jit
def signal(ctr: cute.Tensor, sig: Int32):
    """Thread 0, after order_body_stores: the release add that consumers acquire. The block barrier before it orders
    every thread's stores before thread 0's release (the PTX model's release pattern; CUTLASS's grid barrier
    arrives the same way), so no fence precedes it (a second gpu-scope membar: 0.4-1.7% of a step,
    bench/mega_sync_ab.py)."""
    cute.arch.atomic_add((ctr.iterator + sig).llvm_ptr, Int32(1), sem="release", scope="gpu")


@cute.kernel
def mega_kernel(prog: cute.Tensor, qstart: cute.Tensor, qorder: cute.Tensor, ctr: cute.Tensor, f32: cute.Tensor,
                i32: cute.Tensor, wtab: cute.Tensor, ptab: cute.Tensor, err: cute.Tensor, max_spin: Int32,
                tl: cute.Tensor, timeline: Int32, delay_ns: Int32, RING: cutlass.Constexpr):
    """`RING`: the build with the weight ring (one CTA an SM, a loader warp beside the compute warps; cute/base.py),
    which streams the rows of the program's F_STAGE instructions; the other build has neither (two CTAs an SM).
    `wtab`: the device address of every static tensor of the program's tensor table (weights; 0 for the others),
    `ptab`: of every tensor written in the launch (caches, states; 0 for the others), one index space: a body reads
    a weight's address from wtab and a cache's from ptab, so the audit can tell, per load, what it reads
    (backends/mega/spec.py). `timeline` bit 0: thread 0 records per instruction [wait start, work start, end (globaltimer
    ns), SM, and up to 4 marks its body stamps (base.mark)] in tl, TLW words each. `delay_ns` > 0 (the debug
    build): thread 0 sleeps a random 0..delay_ns after its wait and after its signal, and every warp sleeps its own
    random 0..delay_ns before the body, so that warps store at different times and a signal that does not wait for
    all of them would be seen early; the weight ring's loader sleeps before each page, so that a page read before
    it landed would show."""
    tid, _, _ = cute.arch.thread_idx()
    bid, _, _ = cute.arch.block_idx()
    alloc = SmemAllocator()
    sm = alloc.allocate_tensor(Float32, cute.make_layout(SMEM_F), 16)
    smi = alloc.allocate_tensor(Int32, cute.make_layout(SMEM_I), 16)
    if cutlass.const_expr(RING):
        ring = alloc.allocate_tensor(Int32, cute.make_layout(RING_BYTES // 4), 128)  # the weight ring (cute/base.py)
        mbar = alloc.allocate_tensor(Int64, cute.make_layout(RING_SLOTS), 8)  # its slots' mbarriers
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
    # The queue is a chain: each row names the next instruction of its CTA's queue (isa.W_NEXT). The first row is
    # loaded here; while an instruction waits and runs, lanes 0..9 of warp 1 copy the next row (16 bytes each,
    # cp.async: the instruction stream is static) into NEXT_S, and after the body they move it into ROW_S, so an
    # instruction starts with its row, its waits and its opcode in shared memory instead of global round trips
    # after the previous signal.
    q0 = qstart[bid]
    if tid >= 32 and tid < 32 + ROW and q0 < qstart[bid + 1]:
        first = qorder[q0]
        smi[ROW_S + tid - 32] = prog[first, tid - 32]
        if tid == 32:
            smi[IDX_S] = first
    if cutlass.const_expr(RING):
        if tid == LOADER:
            ring_init(smi, Int32(ring.iterator.toint()), Int32(mbar.iterator.toint()), err.iterator.toint(),
                      max_spin)
    cute.arch.sync_threads()  # every thread, the loader warp's too: the only barrier it joins
    if cutlass.const_expr(RING):
        if tid >= NT:
            if tid == LOADER:  # the weight ring's loader, from the first staged instruction: the first row's, or the
                # one that row names
                first = Int32(-1)
                if q0 < qstart[bid + 1]:
                    first = smi[ROW_S + W_STAGE]
                    if (smi[ROW_S + 3] & F_STAGE) != 0:
                        first = smi[IDX_S]
                loader(pb, wtab, smi, first, delay_ns, epoch, bid)
        else:
            compute(pb, fb, ib, qstart, ctr, wtab, ptab, err, max_spin, tl, timeline, delay_ns, sm, smi, tid, bid,
                    epoch)
    else:
        compute(pb, fb, ib, qstart, ctr, wtab, ptab, err, max_spin, tl, timeline, delay_ns, sm, smi, tid, bid, epoch)


@cute.jit
def compute(pb: Int64, fb: Int64, ib: Int64, qstart: cute.Tensor, ctr: cute.Tensor,
            wtab: cute.Tensor, ptab: cute.Tensor, err: cute.Tensor, max_spin: Int32, tl: cute.Tensor, timeline: Int32,
            delay_ns: Int32, sm: cute.Tensor, smi: cute.Tensor, tid: Int32, bid: Int32, epoch: Int32):
    """The compute warps (threads 0 .. NT - 1): the CTA's queue, an instruction after another."""
    ra = smi.iterator.toint()
    for qi in cutlass.range(qstart[bid], qstart[bid + 1]):
        idx = smi[IDX_S]
        nxt = smi[ROW_S + W_NEXT]
        staged = staged_pages(smi)  # the ring pages this instruction consumes, freed after its body
        if tid >= 32 and tid < 32 + ROW // 4 and nxt >= 0:
            row_copy16(ra + (NEXT_S + 4 * (tid - 32)) * 4, pb + Int64(nxt * ROW + 4 * (tid - 32)) * 4)
        t_wait = Int64(0)
        if tid == 0:
            t_wait = cute.arch.globaltimer()
            ok = wait_counter(ctr, err, smi[ROW_S + 4], smi[ROW_S + 5], smi[ROW_S + 6], epoch, max_spin, idx)
            if ok == 1:
                ok = wait_counter(ctr, err, smi[ROW_S + 7], smi[ROW_S + 8], smi[ROW_S + 9], epoch, max_spin, idx)
            smi[SMEM_I - 1] = ok
            if delay_ns > 0:
                nap(delay_ns, idx, epoch, bid * 4 + 1)
        cta_sync()
        t_start = Int64(0)
        if tid == 0:
            t_start = cute.arch.globaltimer()
        sig = smi[ROW_S + 2]  # read before the row is replaced (after the barrier below)
        if smi[SMEM_I - 1] == 1:
            if delay_ns > 0:  # each warp its own delay before any of its stores
                nap(delay_ns, idx, epoch, (bid * NW + tid // 32) * 4 + 3)
            op = smi[ROW_S]
            for k in cutlass.range_constexpr(len(BODIES)):
                if op == OPCODES[BODIES[k][0]]:
                    BODIES[k][1](pb, idx, fb, ib, wtab, ptab, sm, smi, tid)
        order_body_stores()
        if tid == 0 and sig >= 0 and smi[SMEM_I - 1] == 1:
            signal(ctr, sig)
        if tid == 0 and staged > 0:  # every thread is past its reads of the pages (the barrier above); a body
            # skipped after a failed wait frees its pages too
            smi[RING_S + 4] = smi[RING_S + 4] + staged
            free_pages(smi, smi[RING_S + 4])
        if tid >= 32 and tid < 32 + ROW // 4 and nxt >= 0:  # the next row: landed, then made the current one
            row_copies_landed()
            for j in cutlass.range_constexpr(4):
                smi[ROW_S + 4 * (tid - 32) + j] = smi[NEXT_S + 4 * (tid - 32) + j]
            if tid == 32:
                smi[IDX_S] = nxt
        if tid == 0:
            if (timeline & 1) != 0:
                tl[TLW * idx] = t_wait
                tl[TLW * idx + 1] = t_start
                tl[TLW * idx + 2] = cute.arch.globaltimer()
                tl[TLW * idx + 3] = Int64(cute.arch.smid())
            if delay_ns > 0:
                nap(delay_ns, idx, epoch, bid * 4 + 2)
        cta_sync()


@cute.jit
def launch(prog: cute.Tensor, qstart: cute.Tensor, qorder: cute.Tensor, ctr: cute.Tensor, f32: cute.Tensor,
           i32: cute.Tensor, wtab: cute.Tensor, ptab: cute.Tensor, err: cute.Tensor, max_spin: Int32, tl: cute.Tensor,
           timeline: Int32, delay_ns: Int32, num_ctas: Int32, stream: cuda_drv.CUstream, ring: cutlass.Constexpr):
    mega_kernel(prog, qstart, qorder, ctr, f32, i32, wtab, ptab, err, max_spin, tl, timeline, delay_ns, ring).launch(
        grid=(num_ctas, 1, 1), block=(block_threads(ring), 1, 1), stream=stream)


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


def compile_ptx_cubin(ring: bool = True):
    """cute.compile the launcher (the ring build, or the other) with placeholder tensors, no GPU needed, keeping the
    PTX (`.__ptx__`, what the static audit and the occupancy calculation read; the dump goes to a temporary
    directory) and the DSL's cubin (`.artifacts.CUBIN`). Uncached: `compile_for` is the cached form."""
    dump = tempfile.mkdtemp(prefix="megadecode-cute-")
    return cute.compile(launch, *fake_args(), ring,
                        options=f"--gpu-arch={ARCH} --keep-ptx --keep-cubin --dump-dir={dump}", no_cache=True)


@functools.lru_cache(maxsize=2)
def compile_for(ring: bool = True):
    """A shipped build compiled for the audit, once per process (~70 s on a 2-core CPU)."""
    return compile_ptx_cubin(ring)
