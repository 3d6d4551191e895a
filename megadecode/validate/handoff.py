"""A persistent handoff kernel: the megakernel pattern in miniature, with plantable ordering bugs.

Producer programs compute a chunk of y[s] = W @ x[s] for every step s, store it, then signal the
step's flag (a counter in global memory) with a release atomic. Consumer programs spin on that
flag with an acquire load (bounded: on timeout they write ERR_WAIT_TIMEOUT to `err[pid]` and stop
working instead of hanging), then read y[s] with coherent loads and compute z[s] = V @ y[s].
W and V are static weights: on the GPU they are read through the non-coherent (read-only) path,
which is legal for them and only for them.

Planted mistakes (constexpr flags, one at a time), for the static audit and runtime hunts:
- HOIST: y (produced during the launch) read with a non-coherent `ld.global.nc` load.
- NO_ACQUIRE: spin on a volatile load (`ld.volatile.global`), no acquire.
- RELAXED_SIGNAL: signal with a relaxed atomic (`atom...relaxed`), no release.
- SIGNAL_BEFORE_STORE: the flag is bumped before y is stored.

Triton 3.6 has no `tl.load` option that emits `ld.global.nc` (`cache_modifier` ".ca"/".cg"/".cv",
`eviction_policy` and `volatile` all lower to coherent `ld.global` variants), so the non-coherent
path is emulated with `tl.inline_asm_elementwise` issuing `ld.global.nc.b32`. The interpreter
(TRITON_INTERPRET=1) cannot run inline PTX, so there every load is a plain `tl.load`.

Measured on an H200 (2026-11-29; M=1024, K=2048, N=1024, 32 steps, 50 launches with fresh inputs
per variant): the correct kernel matched the fp64 reference 50/50 with no timeouts, and so did every
planted variant: none of these mistakes shows in plain repeated runs here, which is why
megadecode.validate.audit checks the compiled code. With the producers' signals disabled, the
consumers reported ERR_WAIT_TIMEOUT and wrote nothing.

Programs [0, P) are producers and [P, P + C) consumers: the interpreter runs programs one after
another in program-id order, so producers finish before any consumer waits. On the GPU all
P + C programs must be co-resident (a persistent launch); the launcher checks the SM count.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

ERR_OK = tl.constexpr(0)
ERR_WAIT_TIMEOUT = tl.constexpr(1)
DEFAULT_MAX_SPIN = 1 << 20

PLANTED = ("HOIST", "NO_ACQUIRE", "RELAXED_SIGNAL", "SIGNAL_BEFORE_STORE", "LOAD_BEFORE_WAIT")
# Jitter hooks for the dynamic audit: a per-(producer, step) delay (ns, from DELAYS) before the
# producer's stores, or right after its signal. GPU only (PTX `nanosleep`).
JITTER_POINTS = ("JITTER_BEFORE_STORE", "JITTER_AFTER_SIGNAL")


@triton.jit
def _ld_nc_f32(ptr, mask):
    """Non-coherent (read-only path) fp32 load, masked lanes read 0. For static data only."""
    bits = tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; mov.b32 $0, 0; @p ld.global.nc.b32 $0, [$1]; }",
        "=r,l,r", [ptr, mask.to(tl.int32)], dtype=tl.int32, is_pure=True, pack=1)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _sleep_ns(ns):
    """Sleep about `ns` nanoseconds (PTX nanosleep; the hardware may wake it early or late)."""
    tl.inline_asm_elementwise("{ nanosleep.u32 $1; mov.u32 $0, $1; }", "=r,r", [ns],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _load_f32(ptr, mask, NC: tl.constexpr):
    if NC:
        v = _ld_nc_f32(ptr, mask)
    else:
        v = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    return v


@triton.jit
def _consume(Y, V, s, M, rows, rmask, alive, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             NC_WEIGHTS: tl.constexpr, HOIST: tl.constexpr):
    """z-chunk = V[rows, :] @ y[s, :]; y is produced during the launch: coherent loads, after the acquire."""
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    m0 = 0
    while m0 < M:
        cols = m0 + tl.arange(0, BLOCK_K)
        cmask = (cols < M) & alive
        if HOIST:
            yv = _load_f32(Y + s * M + cols, cmask, NC_WEIGHTS)  # the bug: produced data, .nc
        else:
            yv = tl.load(Y + s * M + cols, mask=cmask, other=0.0, cache_modifier=".cg")
        v = _load_f32(V + rows[:, None] * M + cols[None, :], rmask[:, None] & cmask[None, :], NC_WEIGHTS)
        acc += tl.sum(v * yv[None, :], axis=1)
        m0 += BLOCK_K
    return acc


@triton.jit
def handoff_kernel(W, X, V, Y, Z, FLAGS, ERR, DELAYS,
                   S, K, M, N, max_spin,
                   NUM_PRODUCERS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, NC_WEIGHTS: tl.constexpr, PRODUCERS_ON: tl.constexpr,
                   HOIST: tl.constexpr, NO_ACQUIRE: tl.constexpr, RELAXED_SIGNAL: tl.constexpr,
                   SIGNAL_BEFORE_STORE: tl.constexpr, LOAD_BEFORE_WAIT: tl.constexpr,
                   JITTER_BEFORE_STORE: tl.constexpr, JITTER_AFTER_SIGNAL: tl.constexpr):
    pid = tl.program_id(0)
    if pid < NUM_PRODUCERS:
        # ---- producer: y[s, rows] = W[rows, :] @ x[s, :], then signal flag[s]
        rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < M
        s = 0
        while s < S:  # while loops, not range(runtime): the 3.6 interpreter cannot index a scalar arg
            acc = tl.zeros([BLOCK_M], dtype=tl.float32)
            k0 = 0
            while k0 < K:
                cols = k0 + tl.arange(0, BLOCK_K)
                cmask = cols < K
                w = _load_f32(W + rows[:, None] * K + cols[None, :], rmask[:, None] & cmask[None, :],
                              NC_WEIGHTS)
                xv = tl.load(X + s * K + cols, mask=cmask, other=0.0).to(tl.float32)
                acc += tl.sum(w * xv[None, :], axis=1)
                k0 += BLOCK_K
            if JITTER_BEFORE_STORE:
                _sleep_ns(tl.load(DELAYS + pid * S + s))
            if PRODUCERS_ON:
                if SIGNAL_BEFORE_STORE:
                    tl.atomic_add(FLAGS + s, 1, sem="release", scope="gpu")
                    tl.store(Y + s * M + rows, acc, mask=rmask)
                else:
                    tl.store(Y + s * M + rows, acc, mask=rmask)
                    tl.debug_barrier()  # every thread's stores precede the one thread's release
                    if RELAXED_SIGNAL:
                        tl.atomic_add(FLAGS + s, 1, sem="relaxed", scope="gpu")
                    else:
                        tl.atomic_add(FLAGS + s, 1, sem="release", scope="gpu")
                if JITTER_AFTER_SIGNAL:
                    _sleep_ns(tl.load(DELAYS + pid * S + s))
            s += 1
    else:
        # ---- consumer: wait for flag[s] == NUM_PRODUCERS, then z[s, rows] = V[rows, :] @ y[s, :]
        cid = pid - NUM_PRODUCERS
        rows = cid * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < N
        alive = pid >= 0  # becomes False after a timeout: the program stops working
        s = 0
        while s < S:
            if LOAD_BEFORE_WAIT:  # the bug: produced data read before the wait that guards it
                acc = _consume(Y, V, s, M, rows, rmask, alive, BLOCK_N, BLOCK_K, NC_WEIGHTS, HOIST)
            seen = tl.full((), 0, tl.int32)
            spins = 0
            while alive & (seen < NUM_PRODUCERS) & (spins < max_spin):
                if NO_ACQUIRE:
                    seen = tl.load(FLAGS + s, volatile=True)
                else:
                    seen = tl.atomic_add(FLAGS + s, 0, sem="acquire", scope="gpu")
                spins += 1
            timed_out = alive & (seen < NUM_PRODUCERS)
            tl.store(ERR + pid, ERR_WAIT_TIMEOUT, mask=timed_out)
            alive = alive & (seen >= NUM_PRODUCERS)
            if not LOAD_BEFORE_WAIT:
                acc = _consume(Y, V, s, M, rows, rmask, alive, BLOCK_N, BLOCK_K, NC_WEIGHTS, HOIST)
            tl.store(Z + s * N + rows, acc, mask=rmask & alive)
            s += 1


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _check(name: str, t: torch.Tensor, shape: tuple, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape}")
    if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"{name} must be fp32/fp16/bf16, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")


def handoff(W: torch.Tensor, x: torch.Tensor, V: torch.Tensor, *, block_m: int = 16, block_n: int = 16,
            block_k: int = 32, max_spin: int = DEFAULT_MAX_SPIN, producers_on: bool = True,
            nc_weights: bool | None = None, jitter: str | None = None, delays_ns: torch.Tensor | None = None,
            **planted: bool):
    """z[s] = V @ (W @ x[s]) for every row s of x, in one persistent launch.

    W: [M, K], x: [S, K], V: [N, M] (fp32/fp16/bf16, contiguous, one device). Returns (z [S, N]
    fp32, err [programs] int32: ERR_OK or ERR_WAIT_TIMEOUT per program). `planted` takes the
    PLANTED flags; `producers_on=False` disables the producers' signals (consumers then time out).
    `jitter` ("before_store" | "after_signal") sleeps each producer `delays_ns[producer, step]` ns at
    that point (the dynamic audit's hook; GPU only).
    """
    bad = set(planted) - set(PLANTED)
    if bad:
        raise TypeError(f"unknown planted flags {sorted(bad)}; known: {PLANTED}")
    if W.dim() != 2 or x.dim() != 2 or V.dim() != 2:
        raise ValueError(f"W, x, V must be 2-D, got {W.dim()}, {x.dim()}, {V.dim()}")
    (M, K), S, N = W.shape, x.shape[0], V.shape[0]
    dev = W.device
    _check("W", W, (M, K), dev)
    _check("x", x, (S, K), dev)
    _check("V", V, (N, M), dev)
    for name, b in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        if b < 1 or b & (b - 1):
            raise ValueError(f"{name} must be a power of two, got {b}")
    if min(M, K, N, S) < 1:
        raise ValueError(f"empty problem: M={M} K={K} N={N} S={S}")
    if max_spin < 1:
        raise ValueError(f"max_spin must be >= 1, got {max_spin}")
    interp = interpreting()
    if not interp and dev.type != "cuda":
        raise RuntimeError("handoff needs a CUDA device (or TRITON_INTERPRET=1 for CPU tensors)")
    P, C = triton.cdiv(M, block_m), triton.cdiv(N, block_n)
    if dev.type == "cuda":
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        if P + C > sms:
            raise ValueError(f"persistent launch needs {P + C} co-resident programs, device has {sms} SMs")
    if nc_weights is None:
        nc_weights = not interp
    if jitter not in (None, "before_store", "after_signal"):
        raise ValueError(f"jitter must be None, 'before_store' or 'after_signal', got {jitter!r}")
    if jitter is not None:
        if interp:
            raise RuntimeError("jitter needs the GPU (PTX nanosleep); the interpreter cannot run it")
        if delays_ns is None or tuple(delays_ns.shape) != (P, S) or delays_ns.dtype != torch.int32:
            raise ValueError(f"jitter needs delays_ns as int32 [{P}, {S}] (producers x steps)")
        delays = delays_ns.to(dev).contiguous()
    else:
        delays = torch.zeros((1,), dtype=torch.int32, device=dev)
    y = torch.zeros((S, M), dtype=torch.float32, device=dev)
    z = torch.zeros((S, N), dtype=torch.float32, device=dev)
    flags = torch.zeros((S,), dtype=torch.int32, device=dev)
    err = torch.zeros((P + C,), dtype=torch.int32, device=dev)
    flags_kw = {f: bool(planted.get(f, False)) for f in PLANTED}
    handoff_kernel[(P + C,)](W, x, V, y, z, flags, err, delays, S, K, M, N, max_spin,
                             NUM_PRODUCERS=P, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                             NC_WEIGHTS=nc_weights, PRODUCERS_ON=producers_on,
                             JITTER_BEFORE_STORE=jitter == "before_store",
                             JITTER_AFTER_SIGNAL=jitter == "after_signal", **flags_kw)
    return z, err


def handoff_reference(W: torch.Tensor, x: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
    """Plain torch: z[s] = V @ (W @ x[s]), in fp64, returned as fp32 [S, N]."""
    y = x.double() @ W.double().T
    return (y @ V.double().T).float()


# Roles of handoff_kernel's pointer parameters, for megadecode.validate.audit.
PARAM_ROLES = {"W": "static", "X": "static", "V": "static", "Y": "produced", "Z": "produced",
               "FLAGS": "flag", "ERR": "produced", "DELAYS": "static"}


def handoff_signature() -> dict[str, str]:
    """The sm_90 compile signature of handoff_kernel (constexprs marked "constexpr")."""
    sig = {p: "*fp32" for p in ("W", "X", "V", "Y", "Z")}
    sig.update({"FLAGS": "*i32", "ERR": "*i32", "DELAYS": "*i32", "S": "i32", "K": "i32", "M": "i32", "N": "i32",
                "max_spin": "i32"})
    for c in ("NUM_PRODUCERS", "BLOCK_M", "BLOCK_N", "BLOCK_K", "NC_WEIGHTS", "PRODUCERS_ON") + PLANTED \
            + JITTER_POINTS:
        sig[c] = "constexpr"
    return sig


def handoff_constexprs(nc_weights: bool = True, producers_on: bool = True, jitter: str | None = None,
                       **planted: bool) -> dict:
    bad = set(planted) - set(PLANTED)
    if bad:
        raise TypeError(f"unknown planted flags {sorted(bad)}; known: {PLANTED}")
    c = {"NUM_PRODUCERS": 4, "BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32,
         "NC_WEIGHTS": nc_weights, "PRODUCERS_ON": producers_on}
    c.update({f: bool(planted.get(f, False)) for f in PLANTED})
    c.update({"JITTER_BEFORE_STORE": jitter == "before_store", "JITTER_AFTER_SIGNAL": jitter == "after_signal"})
    return c
