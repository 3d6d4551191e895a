"""The megakernel on the GPU: a scheduled program's device buffers, the compiled CuTe kernel, co-residency and the
error buffer.

One `MegaRuntime` per (model, batch size): the instruction rows, the CTA queues, the counters (word 0 is the launch
number, bumped on the device before each launch so that CUDA-graph replays need no reset), the fp32 and int32
arenas and the tensor table (device addresses of the weights and caches). `launch()` enqueues the bump and the
kernel on the current stream, so a step can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
import math
import os
import re
import struct
import tempfile

import torch

from ..ptxas import assemble  # noqa: F401  (re-exported: callers and tests reach it here)
from .isa import TLW
from .kernel_check import check_program, check_ring
from .program import Program

# spin iterations before a wait reports a timeout (~1-2 s of polling); MEGADECODE_MAX_SPIN overrides
DEFAULT_MAX_SPIN = int(os.environ.get("MEGADECODE_MAX_SPIN", 1 << 20))
ERR_WORDS = 8  # err[0] flag, [1] instruction, [2] counter, [3] value seen, [4] target
_COMPILED = None


class MegaError(RuntimeError):
    """The megakernel reported a wait that timed out (an instruction whose producers never signalled)."""


def kernel_module():
    """backends/mega/cute_kernel.py, imported on first use (it imports cutlass: the `cute` extra)."""
    from . import cute_kernel as K

    return K


def _launch_args(rows, qstart, qorder, ctr, f32, i32, wtab, ptab, err, max_spin, tl, timeline, delay_ns, num_ctas):
    """The launcher's arguments but the stream: the tensors with their layouts dynamic (so one compile serves
    tensors of any size), the scalars as Int32."""
    from cutlass import Int32
    from cutlass.cute.runtime import from_dlpack

    def dyn(t):
        return from_dlpack(t, assumed_align=16).mark_layout_dynamic()

    return (dyn(rows), dyn(qstart), dyn(qorder), dyn(ctr), dyn(f32), dyn(i32), dyn(wtab), dyn(ptab), dyn(err),
            Int32(max_spin),
            dyn(tl), Int32(timeline), Int32(delay_ns), Int32(num_ctas))


def _cute_args(rt: "MegaRuntime"):
    return _launch_args(rt.rows, rt.qstart, rt.qorder, rt.ctr, rt.f32, rt.i32, rt.wtab, rt.ptab, rt.err, rt.max_spin, rt.tl,
                        rt.timeline, rt.delay_ns, rt.num_ctas)


def compile_options(K, dump: str | None = None) -> str:
    """The DSL compile options of the launcher (the disk cache's key holds them without the dump directory)."""
    return f"--gpu-arch={K.ARCH} --keep-cubin" + (f" --dump-dir={dump}" if dump else "")


def ring_build(batch: int) -> bool:
    """Which build runs a program of this batch: the weight ring's (one CTA an SM) where its staged rows are, at
    batch 1 (the rows of a batch-1 MATVEC: Program.stageable), the other (two CTAs an SM, twice the warps) past it.
    Measured on one CTA an SM without the ring, qwen3-30b-a3b batch 8 took 1.25x the time of two (docs/megakernel.md,
    "The weight ring")."""
    return batch == 1


def compile_launcher(device, cache: bool = True, ring: bool = True):
    """Compile the launcher (20-60 s) from placeholder tensors of the runtime's dtypes and ranks on `device`,
    layouts dynamic, so it serves every program; the stream is an argument of each call, not of the compile.
    The cubin is kept: its register count is the residency check's. Uncached: the harness's planted builds
    (validate/mega_plants.py) compile through it with `cache=False` (the DSL's compile cache does not see the
    module attributes they swap); launches share `compiled_launcher`, which also keeps the shipped kernel on disk."""
    from .isa import ROW

    K = kernel_module()  # first: it sets the DSL's architecture before cutlass is imported

    def z(*shape, dtype=torch.int32):
        return torch.zeros(*shape, dtype=dtype, device=device)

    args = _launch_args(z(2, ROW), z(9), z(64), z(64), z(4096, dtype=torch.float32), z(1024),
                        z(16, dtype=torch.int64), z(16, dtype=torch.int64), z(ERR_WORDS), DEFAULT_MAX_SPIN,
                        z(TLW, dtype=torch.int64), 0, 0, 8)
    # the dump directory stays (as compile_for's does): whether the executor reads its files later is not known
    dump = tempfile.mkdtemp(prefix="megadecode-cute-")
    return K.cute.compile(K.launch, *args, K.cuda_drv.CUstream(0), ring, options=compile_options(K, dump),
                          no_cache=not cache)


class Launcher:
    """The shipped kernel's launcher with its register count: compiled in this process, or loaded from the disk
    cache (backends/mega/kernel_cache.py), whose loaded function keeps no cubin to read the count from."""

    def __init__(self, fn, registers: int | None, source: str, keep=None, ring: bool = True):
        self.fn, self.registers, self.source = fn, registers, source  # source: "compiled" or "cache"
        self.ring = ring  # the build (compile_launcher)
        self._keep = keep  # the loaded module: it owns the linked code the function calls

    def __call__(self, *args):
        return self.fn(*args)


def compiled_launcher(device, ring: bool = True):
    """A shipped build's launcher (`ring`: the weight ring's, else the other), once per process: the engine build's
    CTA count (`default_ctas`) and every runtime's launches share it (two compiles made k3-mini's cold start 52.5 s
    on the H200). On a CUDA device it is loaded from the disk cache when an entry for these sources exists, else
    compiled and stored there."""
    global _COMPILED
    if _COMPILED is None:
        _COMPILED = {}
    if ring not in _COMPILED:
        _COMPILED[ring] = _cached_or_compiled(torch.device(device), ring)
    return _COMPILED[ring]


def _compiled_here(device: torch.device, ring: bool) -> Launcher:
    fn = compile_launcher(device, ring=ring)
    return Launcher(fn, cubin_registers(getattr(fn.artifacts, "CUBIN", None)), "compiled", ring=ring)


def _cached_or_compiled(device: torch.device, ring: bool) -> Launcher:
    from . import kernel_cache

    root = kernel_cache.cache_dir() if device.type == "cuda" else None
    if root is None:
        return _compiled_here(device, ring)
    try:
        key = kernel_cache.source_key(compile_options(kernel_module()) + (" ring" if ring else ""))
    except Exception as e:  # noqa: BLE001 (no key, no cache: the compile still serves this process)
        kernel_cache.say(f"the megakernel's cache key could not be computed ({kernel_cache.why(e)}); compiling it")
        return _compiled_here(device, ring)
    hit = kernel_cache.load(root, key)
    if hit is not None:
        (module, fn), registers = hit
        return Launcher(fn, registers, "cache", keep=module, ring=ring)
    kernel_cache.say(f"compiling the megakernel (about a minute, once: it is kept in {root})")
    launcher = _compiled_here(device, ring)
    kernel_cache.store(root, key, launcher.fn, launcher.registers)
    return launcher


def launcher_registers(fn) -> int | None:
    """Registers per thread of a launcher's kernel: a Launcher's own count, else the compiled function's cubin's,
    else (no cubin kept) ptxas's on the PTX of the same kernel compiled without a GPU (~20 s)."""
    regs = fn.registers if isinstance(fn, Launcher) else cubin_registers(
        getattr(getattr(fn, "artifacts", None), "CUBIN", None))
    if regs is None:
        regs = registers_per_thread(kernel_module().compile_for().__ptx__)
    return regs


@functools.lru_cache(maxsize=4)
def registers_per_thread(ptx: str) -> int | None:
    """Registers ptxas allocates per thread for the kernel's PTX (None when no ptxas can assemble it)."""
    cubin, report = assemble(ptx)
    m = re.search(r"Used (\d+) registers", report)
    if m is None:
        import warnings

        warnings.warn(f"no register count for the megakernel: {report[-300:]}")
    return int(m.group(1)) if m else None


def cubin_registers(cubin: bytes | None) -> int | None:
    """Registers per thread of the (largest) kernel in an sm_90 cubin, from its ELF `.nv.info` sections'
    EIATTR_REGCOUNT entries (format 0x04, attribute 0x2f, 8 bytes: the kernel's symbol index, its register count):
    the count the driver launches with, read without running ptxas again. None when absent or not an ELF."""
    if not cubin or cubin[:4] != b"\x7fELF" or cubin[4] != 2:  # ELF64 only
        return None
    try:
        shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
        shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)

        def section(i):  # (name offset, offset, size) of section header i
            h = struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize)
            return h[0], h[4], h[5]

        names = section(shstrndx)[1]
        regs = []
        for i in range(shnum):
            name_off, off, size = section(i)
            name = cubin[names + name_off:cubin.index(b"\0", names + name_off)]
            if not name.startswith(b".nv.info"):
                continue
            p = off
            while p + 4 <= off + size:
                fmt, attr = cubin[p], cubin[p + 1]
                if fmt == 0x04:  # EIFMT_SVAL: a 2-byte length, then the value
                    n = struct.unpack_from("<H", cubin, p + 2)[0]
                    if attr == 0x2F and n == 8:
                        regs.append(struct.unpack_from("<I", cubin, p + 8)[0])
                    p += 4 + n
                elif fmt in (0x01, 0x02, 0x03):  # EIFMT_NVAL / BVAL / HVAL: 4 bytes in all
                    p += 4 if fmt != 0x01 else 2
                else:
                    break
    except (struct.error, ValueError, IndexError):
        return None
    return max(regs) if regs else None


def ctas_per_sm(regs: int | None, threads: int, smem_bytes: int) -> int:
    """CTAs of the kernel that fit on one sm_90 SM at once: registers (64K per SM, allocated per warp in units of
    256), shared memory (228 KiB per SM, 1 KiB reserved per CTA), threads (2048). Unknown registers: 1 (255
    registers per thread always fit one CTA of <= 256 threads)."""
    if regs is None:
        return 1
    per_warp = math.ceil(regs * 32 / 256) * 256
    by_regs = 65536 // (per_warp * (threads // 32))
    by_smem = (228 * 1024) // (smem_bytes + 1024)
    return max(0, min(by_regs, by_smem, 2048 // threads, 32))


class MegaRuntime:
    def __init__(self, prog: Program, device, max_spin: int = DEFAULT_MAX_SPIN, *, timeline: bool = False,
                 delay_ns: int = 0, kernel=None, ring: bool | None = None):
        """`timeline`: record per instruction [wait start, work start, end ns, SM] (`timeline_rows()`);
        `delay_ns` > 0: the debug build's random delays before each instruction's stores and after its signal;
        `kernel`: another build of the launcher to run (the harness's planted ones, validate/mega_plants.py)
        instead of the shipped one; `ring`: which build runs it (default: `ring_build` of the batch for the shipped
        kernel, the ring build for another, as compile_launcher makes it by default)."""
        if not prog.queues:
            raise ValueError("schedule the program first (mega.schedule.schedule)")
        check_program(prog)  # dtypes, loop lengths, alignment, shared-memory bounds: refused here, not misread
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.prog, self.device, self.max_spin = prog, device, max_spin
        self.ring = (ring_build(prog.batch) if kernel is None else True) if ring is None else bool(ring)
        if self.ring:
            check_ring(prog)  # every staged round's pages fit the ring at once
        self.num_ctas = prog.num_ctas
        self.rows = prog.rows(ring=self.ring).to(self.device)
        qstart, qorder = prog.queue_table()
        self.qstart, self.qorder = qstart.to(self.device), qorder.to(self.device)
        self.ctr = torch.zeros(max(prog.counters, 4), dtype=torch.int32, device=self.device)
        self.f32 = torch.zeros(prog.f32_size + 64, dtype=torch.float32, device=self.device)
        self.i32 = torch.zeros(prog.i32_size + 64, dtype=torch.int32, device=self.device)
        for t in prog.tensors:
            if t.role not in ("static", "produced"):
                raise ValueError(f"tensor {t.name} has role {t.role!r}: static or produced")
            if t.tensor.device != self.device:
                raise ValueError(f"tensor {t.name} is on {t.tensor.device}, the runtime on {self.device}")
            if t.tensor.data_ptr() % 16:
                raise ValueError(f"tensor {t.name} is not 16-byte aligned (the kernel's vector loads need it)")
        # the tensor table's addresses in two tables of one index space, by role: the kernel reads a weight's
        # address from wtab and a cache's from ptab (backends/mega/spec.py); the other table holds 0 at that index
        self.wtab = self._table(prog, "static")
        self.ptab = self._table(prog, "produced")
        self.err = torch.zeros(ERR_WORDS, dtype=torch.int32, device=self.device)
        self.timeline, self.delay_ns = int(timeline), int(delay_ns)
        self.tl = torch.zeros(TLW * len(prog.instrs) if timeline else TLW, dtype=torch.int64, device=self.device)
        self._kernel = kernel
        self._compiled = None

    def _table(self, prog: Program, role: str) -> torch.Tensor:
        addr = [t.tensor.data_ptr() if t.role == role else 0 for t in prog.tensors]
        return torch.tensor(addr or [0], dtype=torch.int64, device=self.device)

    def view(self, name: str) -> torch.Tensor:
        if name in self.prog.f32:
            off, n = self.prog.f32[name]
            return self.f32[off:off + n]
        off, n = self.prog.i32[name]
        return self.i32[off:off + n]

    def compile(self):
        """The compiled launcher (`compiled_launcher`: once per process, it serves every program), residency
        checked on first use."""
        if self._compiled is None:
            self._compiled = self._kernel or compiled_launcher(self.device, self.ring)
            self.check_residency()
        return self._compiled

    def check_residency(self) -> None:
        """All CTAs must be resident at once (a CTA spinning on a counter would otherwise wait for a CTA that
        never starts): refuse a launch larger than the GPU holds."""
        K = kernel_module()
        regs = launcher_registers(self._compiled)
        per_sm = ctas_per_sm(regs, K.block_threads(self.ring), K.block_smem(self.ring))
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        if self.num_ctas > per_sm * sms:
            raise ValueError(f"the megakernel launches {self.num_ctas} CTAs; this GPU holds {per_sm} per SM x {sms} "
                             f"SMs = {per_sm * sms} at once")

    def launch(self) -> None:
        K = kernel_module()
        fn = self.compile()
        self.ctr[0:1].add_(1)  # the launch number, on the device (captured with the launch)
        fn(*_cute_args(self), K.current_stream_arg())

    def timeline_rows(self) -> list[dict]:
        """The last launch's per-instruction times (ns, relative to the earliest wait start) and SMs."""
        if not self.timeline:
            raise ValueError("this runtime was made without timeline=True")
        t = self.tl.view(-1, TLW).cpu()
        t0 = int(t[:, 0].min())
        return [{"instr": i, "name": ins.name, "op": ins.op, "layer": ins.layer, "sm": int(t[i, 3]),
                 "wait": int(t[i, 0]) - t0, "start": int(t[i, 1]) - t0, "end": int(t[i, 2]) - t0,
                 "marks": [int(m) - t0 if m else None for m in t[i, 4:].tolist()]}
                for i, ins in enumerate(self.prog.instrs)]

    def check(self) -> None:
        """Raise MegaError when a wait timed out (reads the error buffer: a device sync)."""
        e = self.err.tolist()
        if e[0]:
            ins = self.prog.instrs[e[1]] if 0 <= e[1] < len(self.prog.instrs) else None
            if e[2] in (-2, -3):  # the weight ring (cute/base.py: report_ring_timeout)
                what = {-2: "waited for ring page {p}, which did not land",
                        -3: "the ring's loader waited for a free slot for page {p}"}[e[2]]
                raise MegaError(f"megakernel weight ring timed out: instruction {e[1]} "
                                f"({ins.name if ins else 'the end of its queue'}): " + what.format(p=e[3]))
            raise MegaError(f"megakernel wait timed out: instruction {e[1]} ({ins.name if ins else '?'}) waited on "
                            f"counter {e[2]} ({self.prog.phases[e[2] - 1] if 0 < e[2] <= len(self.prog.phases) else '?'})"
                            f" for {e[4]}, saw {e[3]}")
