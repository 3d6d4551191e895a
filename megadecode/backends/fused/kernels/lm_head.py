"""lm_head and next-token selection on the device (greedy or temperature sampling), two launches, no host sync.

What it replaces: the plan's LM_HEAD op (backends/torch_ops._lm_head: logits = F.linear(x, w).float()) followed
by sampling.sample(logits, params) for top_p == 1. The reference makes several passes over the [B, V] fp32
logits after the projection (log_softmax, softmax, an fp32 noise tensor of the same size, a division, argmax).
Here the projection kernel also reduces each vocab tile to a few numbers per token, and a second, tiny kernel
merges them: the logits are written once (the engine keeps them) and read back only at the chosen token.

Notation: x [B, D] (B tokens), W [V, D], l[b, v] = fp32(round_to_x_dtype(sum_d W[v, d] x[b, d])), which is what
F.linear(x, w).float() computes up to the order of the fp32 accumulation.

1. `lm_head_kernel`, program (vocab tile t of BLOCK_V rows, chunk of BLOCK_B tokens: 16, or up to 64 for larger
   batches so that the weight is streamed once, not once per chunk of 16): the tile's logits
   on tensor cores, weights on the MMA's M side and tokens on its N side ("swap AB", as backends/fused/kernels/latent_moe.py's
   `linear_kernel`, so a handful of tokens pads 16 columns, not 64 rows), fp32 accumulation (fp32 weights:
   IEEE fp32 dots), rounded to x's dtype then fp32 and stored to logits [B, V]. Per (token b, tile t):
       m[b, t] = max_{v in t} l[b, v]          s[b, t] = sum_{v in t} exp(l[b, v] - m[b, t])
       greedy:   a[b, t] = the lowest v in t with l[b, v] = m[b, t]
       sampling: g[b, t] = max_{v in t} (l[b, v] / T - log E[b, v]),  a[b, t] = the lowest v attaining it
   where E[b, v] ~ Exp(1) comes from Triton's counter-based Philox RNG: key = the int64 seed (read from a
   device tensor, so a CUDA graph replays with a new seed written in place), counter = b * V + v. The same
   (seed, row, vocab index) always gives the same draw: results do not depend on the tiling, on the other
   rows of the batch or on timing; a caller draws fresh noise by changing the seed (per step).
2. `finalize_kernel`, one program per token, merges the tiles in index order (fixed: deterministic):
       M = max_t m[b, t],   S = sum_t s[b, t] exp(m[b, t] - M),   logsumexp = M + log S
       token = a[b, t*] with t* the first tile holding the best m (greedy) or g (sampling)
       logprob = (l[b, token] - M) - log S          (log_softmax at temperature 1, as sampling.sample)
   The partials and logits come from the earlier launch: plain (coherent) loads.

Why this samples from softmax(l / T): argmax_v (l_v / T - log E_v) = argmax_v p_v / E_v with p = softmax(l / T)
(the constant logsumexp drops out), the exponential race that sampling.sample runs with torch's generator
(there as p / E, here in log space, so no probability underflows to 0). With independent E_v ~ Exp(1),
P(v wins) = p_v exactly. The Exp(1) draw: u = (r + 1) 2^-32 in (0, 1] from a 32-bit Philox output r, and
E = -log(1 - u): by its Taylor series u + u^2/2 + u^3/3 + u^4/4 for u < 2^-7 (truncation < 2^-30 relative,
below fp32 rounding), otherwise by the log of 1 - u = (2^32 - 1 - r) 2^-32 formed in integers. The small draws
are the ones that decide a race (E small = a large Gumbel value -log E) and they keep their 2^-32 resolution
down to E = 2^-32; the naive -log(u') with an fp32 u' in [0, 1) moves E in steps of 2^-24 near 0 (0.6% of E at
E = 1e-5, the typical winning draw of a flat race over 1e5 tokens). u = 1 (probability 2^-32) gives E = inf:
that token cannot win that race.

Ties: greedy returns the lowest index among equal maxima, as torch.argmax does (documented: "the indices of
the first maximal value"; checked on the CPU, test_greedy_ties_pick_the_lowest_index). NaN logits (a NaN
input) give an unspecified token and a NaN logprob; the reference's torch.argmax would pick the NaN.
top_p < 1 (nucleus sampling) needs the sorted cumulative mass and is not done here: lm_head_sample raises
ValueError and the caller uses sampling.sample on the returned logits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ....contract import Manifest, Scope, Variant, kernel_spec, register
from ....plan import LM_HEAD
from ....sampling import SamplingParams

DEFAULT_BLOCKS = {"BLOCK_V": 64, "BLOCK_K": 128, "BLOCK_T": 1024, "num_warps": 4, "num_stages": 3}
BLOCK_B = 16  # tokens per program: the MMA's N side (the minimum tl.dot tile)
MAX_BLOCK_B = 64  # up to this many for larger batches: at 64 tokens in chunks of 16 the H200 read the 2.3 GB K3
# lm_head four times (2.15 ms against 0.55 ms at batch 8; bench/lm_head_paths.py)
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _exp1_from_bits(r):
    """Exp(1) draws E = -log(1 - u) from uint32 Philox outputs r, u = (r + 1) 2^-32 in (0, 1] (module doc): a
    series where u < 2^-7 (the small E, which decide the race, at 2^-32 resolution), else the log of
    1 - u = (2^32 - 1 - r) 2^-32, formed in integers (no rounding of u near 1). r = 2^32 - 1: u = 1, E = +inf."""
    u = (r.to(tl.float32) + 1.0) * 2.3283064365386963e-10  # 2^-32
    series = u * (1.0 + u * (0.5 + u * (0.3333333333333333 + u * 0.25)))  # -log(1 - u) to u^4
    rest = (r ^ 0xFFFFFFFF).to(tl.float32) * 2.3283064365386963e-10  # 1 - u
    return tl.where(r < 33554431, series, -tl.log(rest))  # r + 1 < 2^25: u < 2^-7


@triton.jit
def lm_head_kernel(x_ptr, w_ptr, seed_ptr, logits_ptr, tmax_ptr, tsum_ptr, targ_ptr, gmax_ptr, garg_ptr,
                   B, V, stride_x, stride_w, stride_l, inv_temp, D: tl.constexpr, SAMPLE: tl.constexpr,
                   BLOCK_V: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (vocab tile, token chunk): logits[b, tile] and the tile's partials for each token (module doc).
    Partial buffers are [B, NT] (NT = number of vocab tiles = the grid's axis 0)."""
    tile = tl.program_id(0)
    v = tile * BLOCK_V + tl.arange(0, BLOCK_V)
    b = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    v_ok = v < V
    b_ok = b < B
    acc = tl.zeros((BLOCK_V, BLOCK_B), dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < D
        # lm_head is read once per step: stream it past L2 (evict_first), keep the activations
        w = tl.load(w_ptr + v[:, None].to(tl.int64) * stride_w + k[None, :], mask=v_ok[:, None] & k_ok[None, :],
                    other=0.0, eviction_policy="evict_first")  # [BLOCK_V, BLOCK_K]
        xt = tl.load(x_ptr + b[None, :].to(tl.int64) * stride_x + k[:, None], mask=k_ok[:, None] & b_ok[None, :],
                     other=0.0)  # [BLOCK_K, BLOCK_B]: x^T, same dtype as w
        if w.dtype == tl.float32:
            acc = tl.dot(w, xt, acc, input_precision="ieee")
        else:
            acc = tl.dot(w, xt, acc)
    # F.linear's output is in x's dtype: round there, then fp32 (a no-op for fp32)
    logits = acc.to(x_ptr.dtype.element_ty).to(tl.float32)  # [BLOCK_V, BLOCK_B]
    tl.store(logits_ptr + b[None, :].to(tl.int64) * stride_l + v[:, None], logits,
             mask=v_ok[:, None] & b_ok[None, :])

    # the tile's statistics per token (rows past V drop out as -inf; every tile has at least one valid row)
    lv = tl.where(v_ok[:, None], logits, float("-inf"))
    m = tl.max(lv, axis=0)  # [BLOCK_B]
    s = tl.sum(tl.exp(lv - m[None, :]), axis=0)
    part = b.to(tl.int64) * tl.num_programs(0) + tile  # [B, NT] row-major
    tl.store(tmax_ptr + part, m, mask=b_ok)
    tl.store(tsum_ptr + part, s, mask=b_ok)
    if SAMPLE:
        seed = tl.load(seed_ptr)  # int64 scalar, written before the launch
        ctr = b[None, :].to(tl.int64) * V + v[:, None]  # the draw's counter: (row, vocab index)
        e = _exp1_from_bits(tl.randint(seed, ctr))
        score = tl.where(v_ok[:, None], lv * inv_temp - tl.log(e), float("-inf"))
        tl.store(gmax_ptr + part, tl.max(score, axis=0), mask=b_ok)
        tl.store(garg_ptr + part, tile * BLOCK_V + tl.argmax(score, axis=0, tie_break_left=True), mask=b_ok)
    else:
        tl.store(targ_ptr + part, tile * BLOCK_V + tl.argmax(lv, axis=0, tie_break_left=True), mask=b_ok)


@triton.jit
def finalize_kernel(logits_ptr, tmax_ptr, tsum_ptr, targ_ptr, gmax_ptr, garg_ptr, tokens_ptr, logprobs_ptr,
                    stride_l, NT: tl.constexpr, SAMPLE: tl.constexpr, BLOCK_T: tl.constexpr):
    """Program b: merge the NT tile partials of token b in tile order, BLOCK_T tiles at a time (module doc);
    write tokens[b] (int64) and logprobs[b] (fp32)."""
    b = tl.program_id(0).to(tl.int64)
    t = tl.arange(0, BLOCK_T)
    big = tl.full((), float("-inf"), tl.float32)  # running max M
    tot = tl.full((), 0.0, tl.float32)  # running sum S, relative to big
    best = tl.full((), float("-inf"), tl.float32)  # best key so far (m or g)
    tok = tl.full((), 0, tl.int32)
    for t0 in range(0, NT, BLOCK_T):
        ok = t0 + t < NT
        at = b * NT + t0 + t
        m = tl.load(tmax_ptr + at, mask=ok, other=float("-inf"))
        s = tl.load(tsum_ptr + at, mask=ok, other=0.0)
        cm = tl.max(m, axis=0)
        cs = tl.sum(tl.where(ok, s * tl.exp(m - cm), 0.0), axis=0)
        new = tl.maximum(big, cm)
        tot = tot * tl.exp(big - new) + cs * tl.exp(cm - new)  # exp(-inf) = 0 on the first chunk
        big = new
        if SAMPLE:
            key = tl.load(gmax_ptr + at, mask=ok, other=float("-inf"))
            idx = tl.load(garg_ptr + at, mask=ok, other=0)
        else:
            key = m
            idx = tl.load(targ_ptr + at, mask=ok, other=0)
        ck = tl.max(key, axis=0)
        first = tl.argmax(key, axis=0, tie_break_left=True)  # the first tile of this chunk holding ck
        ci = tl.sum(tl.where(t == first, idx, 0), axis=0)
        take = ck > best  # strict: an earlier chunk keeps a tie (lower vocab indices)
        tok = tl.where(take, ci, tok)
        best = tl.where(take, ck, best)
    l_tok = tl.load(logits_ptr + b * stride_l + tok)
    tl.store(tokens_ptr + b, tok.to(tl.int64))
    tl.store(logprobs_ptr + b, (l_tok - big) - tl.log(tot))


def _check(x, w, params, seed, out_logits):
    if not isinstance(params, SamplingParams):
        raise ValueError(f"lm_head_sample: params must be a SamplingParams, got {type(params).__name__}")
    if params.truncates:
        raise ValueError(f"lm_head_sample: top_p < 1, top_k or min_p (got {params}) is not supported by the kernel "
                         "(they need the sorted probability mass); use sampling.sample on the returned logits")
    if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor) or x.dim() != 2 or w.dim() != 2 \
            or x.shape[1] != w.shape[1]:
        raise ValueError(f"lm_head_sample: x [B, D] and w [V, D] expected, got "
                         f"{tuple(getattr(x, 'shape', ()))} and {tuple(getattr(w, 'shape', ()))}")
    if x.dtype != w.dtype or w.dtype not in _DTYPES:
        raise ValueError(f"lm_head_sample: x and w must have the same dtype among float32, float16, bfloat16, "
                         f"got x {x.dtype}, w {w.dtype}")
    if w.shape[0] < 1 or w.shape[1] < 1:
        raise ValueError(f"lm_head_sample: w needs V >= 1 rows and D >= 1 columns, got {tuple(w.shape)}")
    if x.device != w.device:
        raise ValueError(f"lm_head_sample: x on {x.device}, w on {w.device}")
    if x.shape[1] > 1 and (x.stride(1) != 1 or w.stride(1) != 1):
        raise ValueError(f"lm_head_sample: x and w need unit stride over D, got strides {x.stride()} and "
                         f"{w.stride()}")
    B, V = x.shape[0], w.shape[0]
    if out_logits is not None and (not isinstance(out_logits, torch.Tensor) or out_logits.shape != (B, V)
                                   or out_logits.dtype != torch.float32 or out_logits.device != x.device
                                   or (V > 1 and out_logits.stride(1) != 1)):
        raise ValueError(f"lm_head_sample: out_logits must be float32 [{B}, {V}] with unit stride over V on "
                         f"{x.device}, got {getattr(out_logits, 'dtype', None)} "
                         f"{tuple(getattr(out_logits, 'shape', ()))}")
    if isinstance(seed, torch.Tensor):
        if seed.dtype != torch.int64 or seed.numel() != 1 or seed.device != x.device:
            raise ValueError(f"lm_head_sample: a seed tensor must be int64 with one element on {x.device}, got "
                             f"{seed.dtype} {tuple(seed.shape)} on {seed.device}")
    elif isinstance(seed, bool) or not isinstance(seed, int) or not -2**63 <= seed < 2**63:
        raise ValueError(f"lm_head_sample: seed must be an int64 value or a device tensor, got {seed!r}")


def _check_out(name: str, t: torch.Tensor | None, B: int, dtype: torch.dtype, device) -> None:
    """An output handed in: None, or a contiguous [B] tensor of `dtype` on `device`."""
    if t is not None and (not isinstance(t, torch.Tensor) or t.shape != (B,) or t.dtype != dtype
                          or t.device != device or not t.is_contiguous()):
        raise ValueError(f"lm_head_sample: {name} must be a contiguous {dtype} [{B}] on {device}, got "
                         f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")


def scratch_specs(B: int, V: int, sample: bool = False, blocks: dict | None = None) -> dict:
    """{name: (shape, dtype)} of the tile partials lm_head_sample writes for B tokens over V vocab rows: per
    (token, vocab tile) the max, the sum of exponentials, the argmax (or race winner) and, when sampling, the
    race's best key."""
    bv = max(16, min({**DEFAULT_BLOCKS, **(blocks or {})}["BLOCK_V"], triton.next_power_of_2(V)))
    nt = triton.cdiv(V, bv)
    specs = {"tmax": ((B, nt), torch.float32), "tsum": ((B, nt), torch.float32), "targ": ((B, nt), torch.int32)}
    return {**specs, "gmax": ((B, nt), torch.float32)} if sample else specs


def _partials(B: int, nt: int, sample: bool, dev, scratch: dict | None) -> tuple:
    """(tmax, tsum, targ, gmax) [B, nt]: the caller's scratch (shapes checked) or fresh buffers; gmax is tmax
    when greedy (unused)."""
    specs = {"tmax": torch.float32, "tsum": torch.float32, "targ": torch.int32, "gmax": torch.float32}
    names = ("tmax", "tsum", "targ") + (("gmax",) if sample else ())
    out = {}
    for n in names:
        t = (scratch or {}).get(n)
        if t is None:
            t = torch.empty(B, nt, dtype=specs[n], device=dev)
        elif t.shape != (B, nt) or t.dtype != specs[n] or t.device != dev or not t.is_contiguous():
            raise ValueError(f"lm_head_sample: scratch {n} must be a contiguous {specs[n]} [{B}, {nt}] on {dev}, "
                             f"got {t.dtype} {tuple(t.shape)}")
        out[n] = t
    return out["tmax"], out["tsum"], out["targ"], out.get("gmax", out["tmax"])


def lm_head_sample(x: torch.Tensor, w: torch.Tensor, params: SamplingParams, seed: int | torch.Tensor = 0,
                   out_logits: torch.Tensor | None = None, *, blocks: dict | None = None,
                   out_tokens: torch.Tensor | None = None, out_logprobs: torch.Tensor | None = None,
                   scratch: dict | None = None):
    """x [B, D] @ w [V, D]^T -> (tokens [B] int64, logprobs [B] fp32, logits [B, V] fp32), as
    `sampling.sample(F.linear(x, w).float(), params)` for greedy or top_p == 1 (module doc), in two launches with
    no host sync. x and w: same dtype (float32/float16/bfloat16), unit stride over D, same device.
    seed: a Python int, or an int64 device tensor of one element read by the kernel (a CUDA graph replays with
    the value written in place); change it per step for fresh noise. Row b's draw depends only on (seed, b).
    out_logits: written in place when given (float32 [B, V], unit stride over V); out_tokens (int64 [B]) and
    out_logprobs (float32 [B]) likewise. blocks: launch parameters (tests and tuning), over DEFAULT_BLOCKS.
    scratch: the tile partials' buffers ({"tmax", "tsum", "targ"}, and "gmax" when sampling; scratch_specs), used
    instead of fresh ones when given. Raises ValueError on bad arguments and for top_p < 1."""
    _check(x, w, params, seed, out_logits)
    B, D = x.shape
    V = w.shape[0]
    dev = x.device
    _check_out("out_tokens", out_tokens, B, torch.int64, dev)
    _check_out("out_logprobs", out_logprobs, B, torch.float32, dev)
    logits = out_logits if out_logits is not None else torch.empty(B, V, dtype=torch.float32, device=dev)
    tokens = out_tokens if out_tokens is not None else torch.empty(B, dtype=torch.int64, device=dev)
    logprobs = out_logprobs if out_logprobs is not None else torch.empty(B, dtype=torch.float32, device=dev)
    if B == 0:
        return tokens, logprobs, logits
    bl = {**DEFAULT_BLOCKS, **(blocks or {})}
    bv = max(16, min(bl["BLOCK_V"], triton.next_power_of_2(V)))
    bk = max(16, min(bl["BLOCK_K"], triton.next_power_of_2(D)))
    nt = triton.cdiv(V, bv)
    bt = max(2, min(bl["BLOCK_T"], triton.next_power_of_2(nt)))
    sample = not params.greedy
    if isinstance(seed, torch.Tensor):
        seed_t = seed.reshape(1)
    else:  # a fill kernel, no host-to-device copy
        seed_t = torch.full((1,), seed, dtype=torch.int64, device=dev)
    tmax, tsum, targ, gmax = _partials(B, nt, sample, dev, scratch)
    inv_temp = 1.0 if params.greedy else 1.0 / params.temperature
    # wider token tiles for 16-bit weights only: with fp32 (IEEE dots, no tensor cores) the H200 gave a row
    # different last bits in a 32-token tile than in a 16-token one (tests/test_lm_head_kernel.py
    # test_batch_invariant); the 16-bit MMAs are checked to give the same bits (test_batch_invariant_16bit_tiles)
    wide = x.dtype != torch.float32
    bb = bl.get("BLOCK_B") or max(BLOCK_B, min(MAX_BLOCK_B if wide else BLOCK_B, triton.next_power_of_2(B)))
    lm_head_kernel[(nt, triton.cdiv(B, bb))](
        x, w, seed_t, logits, tmax, tsum, targ, gmax, targ, B, V, x.stride(0), w.stride(0), logits.stride(0),
        float(inv_temp), D=D, SAMPLE=sample, BLOCK_V=bv, BLOCK_B=bb, BLOCK_K=bk,
        num_warps=bl["num_warps"], num_stages=bl["num_stages"])
    finalize_kernel[(B,)](logits, tmax, tsum, targ, gmax, targ, tokens, logprobs, logits.stride(0), NT=nt,
                          SAMPLE=sample, BLOCK_T=bt, num_warps=4)
    return tokens, logprobs, logits


def audit_specs(dtype: str = "bf16", D: int = 7168, V: int = 163840) -> list:
    """Both kernels, greedy and sampling forms. Roles: w static; x, the seed (a step input a graph or an
    earlier kernel may write), logits, partials and outputs produced (plain loads only)."""
    specs = []
    for sample in (False, True):
        sig = {"x_ptr": f"*{dtype}", "w_ptr": f"*{dtype}", "seed_ptr": "*i64", "logits_ptr": "*fp32",
               "tmax_ptr": "*fp32", "tsum_ptr": "*fp32", "targ_ptr": "*i32", "gmax_ptr": "*fp32",
               "garg_ptr": "*i32", "B": "i32", "V": "i32", "stride_x": "i32", "stride_w": "i32",
               "stride_l": "i32", "inv_temp": "fp32"}
        consts = {"D": D, "SAMPLE": sample, "BLOCK_V": DEFAULT_BLOCKS["BLOCK_V"], "BLOCK_B": BLOCK_B,
                  "BLOCK_K": DEFAULT_BLOCKS["BLOCK_K"]}
        specs.append(kernel_spec(lm_head_kernel, sig, consts, static=("w_ptr",)))
        sig = {"logits_ptr": "*fp32", "tmax_ptr": "*fp32", "tsum_ptr": "*fp32", "targ_ptr": "*i32",
               "gmax_ptr": "*fp32", "garg_ptr": "*i32", "tokens_ptr": "*i64", "logprobs_ptr": "*fp32",
               "stride_l": "i32"}
        consts = {"NT": triton.cdiv(V, DEFAULT_BLOCKS["BLOCK_V"]), "SAMPLE": sample,
                  "BLOCK_T": DEFAULT_BLOCKS["BLOCK_T"]}
        specs.append(kernel_spec(finalize_kernel, sig, consts))
    return specs


# ---- the harness variant (sampling is not a plan op: the greedy tokens and logprobs are side outputs) ----------
def _run(op, inputs, weights, outputs, cfg, step, cache=None):
    lm_head_sample(inputs[op.inputs[0]].contiguous(), weights[op.weights[0]], SamplingParams(greedy=True),
                   out_logits=outputs[op.outputs[0]], out_tokens=outputs.get("tokens"),
                   out_logprobs=outputs.get("logprobs"), scratch=_scratch_of(outputs))


def _scratch_of(outputs: dict) -> dict:
    """The scratch buffers a caller handed in ("scratch.<name>" entries of outputs)."""
    return {n[len("scratch."):]: t for n, t in outputs.items() if n.startswith("scratch.")}


def _scratch(cfg, op, inputs) -> dict:
    """Manifest.scratch: the greedy form's partials for this op's rows."""
    return scratch_specs(inputs[op.inputs[0]].shape[0], cfg.vocab_size)


LM_HEAD_VARIANT = register(Variant(Manifest(
    name="triton-lm-head",
    description="lm_head on tensor cores with per-vocab-tile max / sum-exp / argmax (or Gumbel race) partials "
                "and a merge kernel: logits plus the next token and its logprob in two launches. The harness "
                "checks the logits (the LM_HEAD op's output) and the greedy tokens and logprobs (side outputs); "
                "the fused executor runs it when it samples in the step (FusedExecutor.set_sampling)",
    replaces=(LM_HEAD,),
    scope=Scope(families=("qwen3_moe", "deepseek_v3", "kimi_linear", "kimi_k3"),
                dtypes=("float32", "float16", "bfloat16"), devices=("cpu", "cuda"), batch=(1, 256), arch="sm_90"),
    sources=("megadecode/backends/fused/kernels/lm_head.py",), uses_triton=True, graph_capturable=True, kernels=audit_specs,
    side_outputs=("tokens", "logprobs"), scratch=_scratch),
    _run, kernel=lm_head_kernel))
