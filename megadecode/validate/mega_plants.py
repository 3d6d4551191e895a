"""The harness's own planted mistakes in the megakernel: each is a build of the kernel with one ordering or coverage
bug swapped in, which a named check must catch. They live here, beside the checks, not in the shipped kernel: a
plant replaces one of the module-level functions the kernel is traced from (backends/mega/cute_kernel.py's synchronisation
steps, an opcode body's helper) for the length of one compile, so the shipped source holds no switch for them.

Each plant says which check catches it: a rule of the static audit (validate/audit.py, on the CPU, in CI) or a GPU
check (validate/mega_gpu.py: every buffer against pyvm over long attention splits, the timeout test). The audit's
plants compile with a few opcode bodies (`bodies`: a second instead of ~100 on a 2-core CPU); the GPU's with all.
`nc_weights` is the control: weights read through the non-coherent path, which the audit must pass.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from ..contract.kernels import register_spec_kind
from ..backends.mega.spec import MegaKernelSpec


@dataclass(frozen=True)
class Plant:
    name: str
    what: str
    caught_by: tuple[str, ...]  # "audit:<rule>" or "gpu:<check>"
    bodies: tuple[str, ...]  # the opcode bodies its audit build compiles


PLANTS = {p.name: p for p in (
    Plant("relaxed_signal", "the signal is a relaxed add with no fence: the data it publishes may land after it",
          ("audit:signal-without-release",), ("EMBED",)),
    Plant("weak_wait", "the spin-wait polls with relaxed loads: what it guards may be read stale",
          ("audit:wait-without-acquire",), ("EMBED",)),
    Plant("no_body_barrier", "no block barrier between the body and the signal: thread 0 signals when its own "
          "stores are done, other warps' still in flight", ("audit:signal-before-barrier", "gpu:delayed-build"),
          ("EMBED",)),
    Plant("silent_timeout", "a wait that reaches its spin limit proceeds as if satisfied and records nothing",
          ("audit:timeout-unreported", "gpu:timeout"), ("EMBED",)),
    Plant("nc_cache", "MLA_ATTN reads the latent cache, written earlier in the same launch by MLA_KV, through the "
          "non-coherent path", ("audit:nc-load-of-produced",), ("MLA_KV", "MLA_ATTN")),
    Plant("skip_last_chunk", "attention skips the last partial 64-position chunk of a split longer than one chunk",
          ("gpu:long-splits",), ("ATTN_GQA",)),
    Plant("ring_overtake", "the staged MATVEC body frees the ring's pages a whole ring ahead of its reads: the "
          "loader refills slots still being read (a page reused before its readers are done)",
          ("gpu:delayed-build",), ("MATVEC",)),
    Plant("ring_no_wait", "the staged MATVEC body reads its pages without waiting for them to land",
          ("gpu:delayed-build",), ("MATVEC",)),
)}
CONTROLS = {"nc_weights": Plant("nc_weights", "EMBED reads the embedding rows (static) through the non-coherent "
                                "path: the audit must pass it", (), ("EMBED",))}


def _patches(name: str) -> list[tuple[object, str, object]]:
    """(module, attribute, replacement) for a plant: imported here, on use, since they import cutlass."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32, Int64, Uint32

    from ..backends.mega import cute_kernel as K
    from ..backends.mega.cute import attention, base, dense

    acquire = K.wait_load

    @cute.jit
    def relaxed_signal(ctr: cute.Tensor, sig: Int32):
        cute.arch.atomic_add((ctr.iterator + sig).llvm_ptr, Int32(1), sem="relaxed", scope="gpu")

    @cute.jit
    def weak_wait_load(p) -> Int32:
        return cute.arch.load(p, Int32, sem="relaxed", scope="gpu")

    @cute.jit
    def no_barrier():
        pass

    @cute.jit
    def silent_wait_counter(ctr: cute.Tensor, err: cute.Tensor, c_idx: Int32, need: Int32, per: Int32, epoch: Int32,
                            max_spin: Int32, instr: Int32) -> Int32:
        if c_idx >= 0:
            target = (epoch - 1) * per + need
            p = (ctr.iterator + c_idx).llvm_ptr
            v = acquire(p)
            spins = Int32(0)
            while (v - target) < 0 and spins < max_spin:
                v = acquire(p)
                spins += 1
        return Int32(1)

    @cute.jit
    def ld8_nc(dtype: cutlass.Constexpr, addr: Int64):
        """8 bf16 through `ld.global.nc` (the read-only path), as fp32."""
        w = cute.arch.inline_ptx("ld.global.nc.v4.b32 { {$w0}, {$w1}, {$w2}, {$w3} }, [{$r0}];",
                                 write_only_types=[Uint32, Uint32, Uint32, Uint32], read_only_args=[addr])
        r = cute.make_rmem_tensor(8, Float32)
        for j in cutlass.range_constexpr(4):
            r[2 * j] = base.from_bits(w[j] << Uint32(16))
            r[2 * j + 1] = base.from_bits(w[j] & Uint32(0xFFFF0000))
        return r.load()

    @cute.jit
    def ldf_nc(dtype: cutlass.Constexpr, addr: Int64) -> Float32:
        """A bf16 scalar through `ld.global.nc` as fp32; other dtypes as base.ldf reads them."""
        if cutlass.const_expr(dtype is BFloat16):
            h = cute.arch.inline_ptx("{ .reg .b16 t; ld.global.nc.b16 t, [{$r0}]; cvt.u32.u16 {$w0}, t; }",
                                     write_only_types=[Uint32], read_only_args=[addr])
            return base.from_bits(h << Uint32(16))
        return base.ldf(dtype, addr)

    whole_split = attention.split_bounds

    def short_split_bounds(s, S, pos):
        lo, hi = whole_split(s, S, pos)
        n = hi - lo
        return lo, lo + n - (n % attention.CH) * cutlass.min(1, cutlass.max(0, n - attention.CH))

    @cute.jit
    def free_ahead(smi: cute.Tensor, upto: Int32):
        base.free_pages(smi, upto + base.RING_SLOTS)

    @cute.jit
    def no_page_wait(smi: cute.Tensor, page: Int32, idx: Int32):
        pass

    return {"relaxed_signal": [(K, "signal", relaxed_signal)],
            "weak_wait": [(K, "wait_load", weak_wait_load)],
            "no_body_barrier": [(K, "order_body_stores", no_barrier)],
            "silent_timeout": [(K, "wait_counter", silent_wait_counter)],
            "nc_cache": [(attention, "ld8", ld8_nc)],
            "skip_last_chunk": [(attention, "split_bounds", short_split_bounds)],
            "nc_weights": [(dense, "ldf", ldf_nc)],
            "ring_overtake": [(dense, "free_pages", free_ahead)],
            "ring_no_wait": [(dense, "page_wait", no_page_wait)],
            }[name]


def plant(name: str) -> Plant:
    p = PLANTS.get(name) or CONTROLS.get(name)
    if p is None:
        raise ValueError(f"unknown plant {name!r}; plants: {', '.join(PLANTS)}; controls: {', '.join(CONTROLS)}")
    return p


@contextlib.contextmanager
def planted(name: str, bodies: tuple[str, ...] | None = None):
    """Inside: the kernel's module attributes the plant replaces, and BODIES cut to `bodies` (None: all). Compile
    inside (uncached); every attribute is restored on exit."""
    plant(name)
    from ..backends.mega import cute_kernel as K

    swaps = _patches(name)
    if bodies is not None:
        unknown = set(bodies) - {b[0] for b in K.BODIES}
        if unknown:
            raise ValueError(f"no opcode bodies {sorted(unknown)}")
        swaps.append((K, "BODIES", tuple(b for b in K.BODIES if b[0] in bodies)))
    saved = [(mod, attr, getattr(mod, attr)) for mod, attr, _ in swaps]
    try:
        for mod, attr, new in swaps:
            setattr(mod, attr, new)
        yield K
    finally:
        for mod, attr, old in reversed(saved):
            setattr(mod, attr, old)


def planted_ptx(name: str, bodies: tuple[str, ...] | None = None) -> str:
    """The PTX of a planted build, compiled without a GPU (the plant's audit bodies by default)."""
    with planted(name, plant(name).bodies if bodies is None else bodies) as K:
        return K.compile_ptx_cubin().__ptx__


def planted_launcher(name: str, device, bodies: tuple[str, ...] | None = None):
    """A planted build, compiled for launches on `device` (MegaRuntime(..., kernel=...)): every body by default;
    `bodies` cuts them (a timeout test needs only the waits: the other opcodes then compute nothing)."""
    from ..backends.mega.runtime import compile_launcher

    with planted(name, bodies):
        return compile_launcher(device, cache=False)


@dataclass(frozen=True)
class PlantedMegaKernelSpec(MegaKernelSpec):
    """The megakernel with one planted mistake (or a control), for the audit: compiled with the plant's bodies."""

    plant: str = ""

    @property
    def name(self) -> str:
        return f"mega_kernel+{self.plant}"

    def key(self) -> str:
        return super().key() + f"+{self.plant}"

    def portable(self) -> dict:
        return {"kind": "cute-plant", "plant": self.plant}

    def ptx(self) -> str:
        return planted_ptx(self.plant)


register_spec_kind("cute-plant", lambda d: PlantedMegaKernelSpec(plant=d["plant"]))


def audit_plant(name: str, sass: bool = False):
    """The static audit of one planted build (validate/audit.py's rules, the megakernel's roles)."""
    from .audit import audit_spec

    return audit_spec(PlantedMegaKernelSpec(plant=name), arch=90, sass=sass)
