"""The engine: weights + cache + an executor, and the prefill/decode loop around them."""

from __future__ import annotations

import operator
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .cache import KVCache
from .checkpoint import load_weights
from .config import ModelConfig, load_config
from .backends import EXECUTORS
from .backends.base import Executor
from .memory import check_fits
from .plan import build_plan
from .presets import PRESETS, preset_config
from .quant.mxfp4_frag import entry_shape
from .sampling import Counts, SamplingParams, sample
from .step import Step
from .weights import mtp_specs, param_specs, random_weights

MAX_SEED = 2**32 - 1  # generate's in-step sampler derives a seed per step as seed * 1_000_003 + step (int64)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class RequestError(ValueError):
    """A request the engine cannot serve (bad token ids, too long, too many sequences)."""


class NonFiniteError(ValueError):
    """The model produced NaN or inf logits (broken weights, or an overflow): generation cannot go on."""


@dataclass
class GenerationResult:
    token_ids: list[list[int]]
    logprobs: list[list[float]]
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0
    extra: dict = field(default_factory=dict)
    # before prefill_s: compiles and graph captures (Engine.warmup), so that decode_s is the steady rate
    warmup_s: float = 0.0
    warmup_steps: int = 0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_steps * len(self.token_ids) / self.decode_s if self.decode_s > 0 else 0.0


QUANT_DTYPES = {"mxfp4": torch.uint8, "fp8": torch.float8_e4m3fn, "fp8_scale": torch.float32}  # ParamSpec.quant


def check_weights(cfg: ModelConfig, weights: dict[str, torch.Tensor], shard=None, specs: dict | None = None) -> None:
    """Every tensor of the weight table present, with its shape (stacked MXFP4 experts in the checkpoint's order
    or in fragment order, quant/mxfp4_frag.entry_shape), on one device; quantized experts in their
    storage dtype (QUANT_DTYPES: kimi_k3's MXFP4 halves uint8, FP8 values and their fp32 scales), everything else
    floating point. `shard` (expert parallelism): stacked experts hold that rank's experts only. `specs`: another
    table than the model's (the MTP layer's)."""
    devices = set()
    for name, spec in (param_specs(cfg, shard) if specs is None else specs).items():
        if name not in weights:
            raise RequestError(f"weights are missing {name!r} (shape {list(spec.shape)})")
        t = weights[name]
        if spec.quant == "mxfp4" and spec.stacked and (t.dim() == 4 if name.endswith(".weight_packed") else
                                                        t.dim() == 3 and t.shape[-1] == 0):
            want = entry_shape(name, spec.shape)  # K3's routed experts in fragment order (backends/expert_layout.py)
        else:
            want = spec.shape
        if tuple(t.shape) != want:
            raise RequestError(f"weight {name!r} has shape {list(t.shape)}, expected {list(want)}")
        if spec.quant:
            want = QUANT_DTYPES[spec.quant]
            if t.dtype != want:
                raise RequestError(f"weight {name!r} has dtype {t.dtype}; expected {want} ({spec.quant}, kept "
                                   f"quantized)")
        elif not t.is_floating_point():
            raise RequestError(f"weight {name!r} has dtype {t.dtype}; expected a floating dtype")
        devices.add(t.device)
    if len(devices) > 1:
        raise RequestError(f"weights are spread over several devices {sorted(map(str, devices))}")


def executor_class(name: str, cfg: ModelConfig):
    """The executor class `name`, once it says it runs this model's family (config/registry.py): an unknown name
    is a ValueError, an executor not validated for the family a RequestError, both naming the choices."""
    if name not in EXECUTORS:
        raise ValueError(f"unknown executor {name!r}; choose from {sorted(EXECUTORS)}")
    why = EXECUTORS[name].supports(cfg)
    if why:
        raise RequestError(why)
    return EXECUTORS[name]


def check_seed(seed) -> None:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise RequestError(f"seed must be an integer in [0, {MAX_SEED}], got {seed!r}")


def resolve_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {sorted(DTYPES)}")
    return DTYPES[dtype]


def cache_dims(cfg: ModelConfig, max_batch: int, max_seq_len: int | None) -> tuple[int, int]:
    """The cache's (sequences, positions) for these arguments (max_seq_len None: the model's context, at most
    4096), checked against the model."""
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise RequestError(f"max_batch must be a positive integer, got {max_batch!r}")
    if max_seq_len is None:
        return max_batch, min(4096, cfg.max_position_embeddings)
    if not 1 <= max_seq_len <= cfg.max_position_embeddings:
        raise RequestError(f"max_seq_len {max_seq_len} is outside [1, {cfg.max_position_embeddings}], the model's "
                           f"context (max_position_embeddings in its config.json)")
    return max_batch, max_seq_len


def model_config(model: str) -> ModelConfig:
    """The config of `model`: a preset name or an HF checkpoint directory (its config.json)."""
    if model in PRESETS:
        return preset_config(model)
    if not Path(model).is_dir():
        raise FileNotFoundError(f"--model {model!r} is neither a preset ({', '.join(sorted(PRESETS))}) "
                                "nor a checkpoint directory")
    return load_config(model)


class Engine:
    """`parallel` (megadecode.parallel.combine.ExpertParallel): this process is one rank of expert parallelism;
    `weights` hold its experts only, and every rank must run the same calls in the same order (the MoE layers'
    combines are collectives). None: one process holds the whole model.
    The engine takes `weights`: its executor may replace K3's routed expert tensors in that dict with the order it
    reads (the fused executor's fragment order; backends/expert_layout.py), so that the experts' bytes are held
    once; an engine built later on the same dict turns them back if it reads the other order.
    `weights` may hold the MTP layer's tensors too (weights.mtp_specs): they are kept apart in `mtp_weights` (the
    MTP drafter's, speculative.MtpDrafter; the decode step never reads them); None when there are none."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], *, executor: str = "torch",
                 max_batch: int = 8, max_seq_len: int | None = None, parallel=None):
        ex = executor_class(executor, cfg)
        self.cfg = cfg
        self.parallel = parallel
        shard = None if parallel is None else parallel.shard
        self.mtp_weights = _mtp_weights(cfg, weights, shard)
        if self.mtp_weights is not None:
            weights = {n: t for n, t in weights.items() if n not in self.mtp_weights}
        check_weights(cfg, weights, shard)
        any_w = next(iter(weights.values()))
        self.device, self.dtype = any_w.device, any_w.dtype
        max_batch, self.max_seq_len = cache_dims(cfg, max_batch, max_seq_len)
        self.cache = KVCache(cfg, max_batch, self.max_seq_len, self.device, self.dtype)
        self.plan = build_plan(cfg)
        self.executor: Executor = ex(self.plan, weights, self.cache, parallel=parallel)
        self.lengths: list[int] = []
        self._slots = torch.arange(max_batch, device=self.device)

    @classmethod
    def from_pretrained(cls, model: str, *, device="cpu", dtype="float32", seed: int = 0,
                        check_finite: bool = False, ignore_unknown: bool = False, max_batch: int = 8,
                        max_seq_len: int | None = None, parallel=None, progress=None, mtp: bool = False,
                        **kw) -> "Engine":
        """`model` is a preset name (random weights, built on `device`) or an HF checkpoint directory. Whether the
        weights and the cache fit in the device's memory is checked before either is built (memory.check_fits).
        `parallel`: this rank's share of expert parallelism (its experts alone are built or read). `progress`:
        called as progress(bytes, total bytes) while the weights are built or read (a progress bar's feed).
        `mtp`: the MTP layer's weights too (`mtp_weights`, for speculative.MtpDrafter; its cache counted in the fit
        check); a model without one is refused at once."""
        dt = resolve_dtype(dtype)
        if str(device).startswith("cuda") and not torch.cuda.is_available():
            raise RequestError(f"device {device!r} requested but CUDA is not available")
        check_seed(seed)
        cfg = model_config(model)
        shard = None if parallel is None else parallel.shard
        ex = executor_class(kw.get("executor", "torch"), cfg)
        dims = cache_dims(cfg, max_batch, max_seq_len)
        extra = ex.build_extra(cfg, device, dt, shard)
        if mtp:
            from .mtp import mtp_bytes, mtp_refusal

            why = mtp_refusal(cfg)
            if why:
                raise RequestError(f"{model}: {why}")
            if parallel is not None:
                raise RequestError("the MTP drafter runs in one process (no expert parallelism)")
            more, also = mtp_bytes(cfg, dt, *dims), "for the MTP layer's weights and cache"
            extra = (more, also) if extra is None else (extra[0] + more, f"{extra[1]} and {also}")
        check_fits(model, cfg, device, dt, *dims, shard=shard, extra=extra)
        kw.update(max_batch=max_batch, max_seq_len=max_seq_len, parallel=parallel)
        if model in PRESETS:
            return cls(cfg, random_weights(cfg, device, dt, seed, shard, progress, mtp=mtp), **kw)
        _, weights = load_weights(model, cfg, device=device, dtype=dt, check_finite=check_finite,
                                  ignore_unknown=ignore_unknown, shard=shard, progress=progress, mtp=mtp)
        return cls(cfg, weights, **kw)

    # ---- request checks -------------------------------------------------------------------------
    def check_request(self, prompts: list[list[int]], max_new_tokens: int) -> None:
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise RequestError("no prompts given: prompts must be a non-empty list of token-id lists")
        if not all(isinstance(p, (list, tuple)) for p in prompts):
            raise RequestError("each prompt must be a list of token ids (got a flat list? wrap it: [[...]])")
        if len(prompts) > self.cache.num_slots:
            raise RequestError(f"{len(prompts)} sequences do not fit: the cache holds {self.cache.num_slots} "
                               f"(raise max_batch)")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise RequestError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        V = self.cfg.vocab_size
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise RequestError(f"prompt {i} is empty")
            for t in p:
                if isinstance(t, bool) or not hasattr(t, "__index__"):
                    raise RequestError(f"prompt {i} has token id {t!r}, which is not an integer")
                if not 0 <= operator.index(t) < V:
                    raise RequestError(f"prompt {i} has token id {t!r} outside the vocabulary [0, {V})")
            if len(p) + max_new_tokens > self.max_seq_len:
                raise RequestError(f"prompt {i} has {len(p)} tokens; with {max_new_tokens} new tokens it needs "
                                   f"{len(p) + max_new_tokens} positions, more than the context of "
                                   f"{self.max_seq_len}")

    # ---- steps ----------------------------------------------------------------------------------
    def prefill(self, prompts: list[list[int]], max_new_tokens: int = 0, hidden: list | None = None) -> torch.Tensor:
        """Start a new batch (slot i = prompt i). Returns next-token logits [B, V] (fp32). `hidden`: as
        prefill_into's."""
        self.check_request(prompts, max_new_tokens)
        logits = self.prefill_into(prompts, list(range(len(prompts))), hidden)
        self.lengths = [len(p) for p in prompts]
        return logits

    def prefill_into(self, prompts: list[list[int]], slots: list[int], hidden: list | None = None) -> torch.Tensor:
        """Prefill prompts[i] into cache slot slots[i] (distinct slots; positions from 0), writing no other slot:
        the server's newcomers join while the other slots' sequences keep their cache. The prompts are checked
        by the caller (check_request). Returns next-token logits [len(prompts), V] (fp32). `hidden`: a list, to
        which the last layer's output of every prompt token is appended, the prompts' rows in order [sum of
        lengths, D] (Step.last_hidden: the MTP drafter's input)."""
        if len(set(slots)) != len(slots) or not all(0 <= s < self.cache.num_slots for s in slots):
            raise RequestError(f"slots {slots} must be distinct and in [0, {self.cache.num_slots})")
        dev = self.device
        lens = [len(p) for p in prompts]
        starts = [sum(lens[:i]) for i in range(len(lens))]
        step = Step(
            tokens=torch.tensor([operator.index(t) for p in prompts for t in p], device=dev),
            positions=torch.cat([torch.arange(n) for n in lens]).to(dev),
            slots=torch.cat([torch.full((n,), s) for s, n in zip(slots, lens)]).to(dev),
            logit_rows=torch.tensor([s + n - 1 for s, n in zip(starts, lens)], device=dev),
            kv_len=max(lens), segments=[(s, s + n, slot) for s, n, slot in zip(starts, lens, slots)],
            last_hidden=hidden)
        return self.executor.prefill(step)

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """One token per running sequence (tokens [B] on the device). Returns logits [B, V]. With a captured step
        (graph, fused, mega executors on CUDA) they are the graph's output buffer, overwritten by the next step:
        clone them to keep them."""
        B = len(self.lengths)
        if tokens.shape != (B,):
            raise RequestError(f"decode expects {B} tokens, got shape {tuple(tokens.shape)}")
        if max(self.lengths) >= self.max_seq_len:
            raise RequestError(f"a sequence reached the context limit of {self.max_seq_len}")
        step = Step(tokens=tokens, positions=torch.tensor(self.lengths, device=self.device),
                    slots=self._slots[:B], logit_rows=self._slots[:B], kv_len=max(self.lengths) + 1,
                    contiguous_slots=True)
        self.lengths = [n + 1 for n in self.lengths]
        return self.executor.decode(step)

    def decode_into(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, kv_len: int
                    ) -> torch.Tensor:
        """One decode step of the sequences in cache slots `slots` (any order, not contiguous), token n at
        positions[n] (all [B] int64 on the device); kv_len > max(positions). Returns logits [B, V]."""
        return self.executor.decode(Step(tokens=tokens, positions=positions, slots=slots,
                                         logit_rows=self._slots[:tokens.shape[0]], kv_len=kv_len))

    def warmup(self, batch_sizes: list[int], kv_lo: int, kv_hi: int, *, slot: int | None = None,
               causal_rows: bool = False, verify_sizes: list[int] = (), progress=None) -> int:
        """Compile and capture, before any timed or served step, every decode graph that steps of these batch
        sizes with kv_len in [kv_lo, kv_hi] will replay (executor.graph_lengths: one per batch size where the
        step reads the lengths from the device, one per cache-length bucket otherwise; none when it runs
        eagerly). `slot`: the rows of the warm-up steps all use this cache slot (the server's scratch slot);
        None: rows 0..B-1 (generate: its prefill then overwrites them). Positions are 0, so a warm-up step
        writes position 0 of those slots only. `causal_rows`: the graphs of speculative verify steps (Step.causal_rows:
        the rows continue one sequence; the megakernel builds another program for them). `verify_sizes`: row counts
        whose causal-rows graphs are warmed too, after the others (a server's speculative verify steps, padded to
        them: ModelRunner.verify_sizes). Returns the number of steps run; `progress.update(1)` after each."""
        todo = [(B, L, causal_rows) for B in batch_sizes for L in self.executor.graph_lengths(B, kv_lo, kv_hi)]
        todo += [(B, L, True) for B in verify_sizes for L in self.executor.graph_lengths(B, kv_lo, kv_hi)]
        if progress is not None and hasattr(progress, "total"):
            progress.total = len(todo)
            progress.refresh()
        if verify_sizes and slot is None:
            raise ValueError("verify_sizes need a slot for their rows (rows past the cache's slots share it)")
        for B, L, causal in todo:
            zeros = torch.zeros(B, dtype=torch.int64, device=self.device)
            slots = self._slots[:B] if slot is None else torch.full((B,), slot, device=self.device)
            rows = torch.arange(B, device=self.device)
            self.executor.decode(Step(tokens=zeros, positions=zeros, slots=slots, logit_rows=rows,
                                      kv_len=L, contiguous_slots=slot is None, causal_rows=causal))
            if progress is not None:
                progress.update(1)
        if todo and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return len(todo)

    def generate(self, prompts: list[list[int]], max_new_tokens: int, sampling: SamplingParams = SamplingParams(),
                 *, seed: int = 0, stop_at_eos: bool = True, min_tokens: int = 0, progress=None,
                 warmup_progress=None, prefill_progress=None, guides: list | None = None) -> GenerationResult:
        """Generate up to `max_new_tokens` per prompt. Tokens stay on the device during the loop; the
        host reads them once at the end (sequences are cut after their first EOS). Every graph the decode steps
        replay is compiled and captured first (`warmup_s`), so `decode_s` times steady steps only. `min_tokens`:
        no EOS is drawn among a sequence's first min_tokens tokens (vLLM's). Progress (tqdm bars, or anything with
        `update(n)`): `warmup_progress` a graph at a time (its `total` set first), `prefill_progress` the prompts'
        tokens once the prefill is done, `progress` a decode step at a time. `guides`: structured output, one
        structured.Guide (or None) per prompt: before each sampling the tokens its grammar does not allow are masked,
        each sampled token is given to it (a host round trip a step), and once it has taken its stop token (EOS)
        the sequence is done (needs `stop_at_eos`)."""
        check_seed(seed)
        self.check_request(prompts, max_new_tokens)
        if guides is not None:
            if len(guides) != len(prompts):
                raise RequestError(f"{len(guides)} guides for {len(prompts)} prompts (one each, None: unguided)")
            if not stop_at_eos:
                raise RequestError("a guided sequence ends at its grammar's stop token (EOS): it cannot ignore EOS")
            guides = list(guides) if any(g is not None for g in guides) else None
        if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or not 0 <= min_tokens <= max_new_tokens:
            raise RequestError(f"min_tokens must be an integer in [0, max_new_tokens = {max_new_tokens}], got "
                               f"{min_tokens!r}")
        eos_ban = [tuple(self.cfg.eos_token_id)] * len(prompts)
        gen = torch.Generator(device=self.device).manual_seed(seed)
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        tw = time.perf_counter()
        # executors that sample inside the captured decode step (fused: backends/fused/kernels/lm_head.py) take greedy
        # and plain temperature sampling; the first token (prefill) and top-p, top-k, min-p, logit bias and the
        # penalties use sampling.sample, and so do all steps under min_tokens (the in-step samplers ban no token)
        in_step = self.executor.set_sampling(None if min_tokens or guides else sampling, len(prompts))
        # compiles and captures happen here, not in the timed loop: every graph the decode steps will replay
        lens = [len(p) for p in prompts]
        warm_steps = self.warmup([len(prompts)], max(lens) + 1, max(lens) + max_new_tokens - 1,
                                 progress=warmup_progress) if max_new_tokens > 1 else 0
        sync()
        self.executor.first_nonfinite.fill_(-1)  # written by every step on the device, read once at the end
        t0 = time.perf_counter()
        logits = self.prefill(prompts, max_new_tokens)
        if prefill_progress is not None:
            sync()  # the bar says done when it is
            prefill_progress.update(sum(lens))
        toks, lps = [], []
        counts = rows = None
        if sampling.penalized:  # the penalties read each sequence's token counts, kept on the device
            counts = Counts(len(prompts), self.cfg.vocab_size, self.device)
            counts.start(range(len(prompts)), prompts)
            rows = torch.arange(len(prompts), device=self.device)
        if max_new_tokens:
            tok, lp = sample(_guided(logits, guides), sampling, gen, counts, eos_ban if min_tokens > 0 else None)
            _take(guides, tok)
            toks.append(tok), lps.append(lp)
            if counts is not None:
                counts.add(rows, tok)
        sync()
        t1 = time.perf_counter()
        for k in range(max_new_tokens - 1):
            if in_step:
                self.executor.seed.fill_(seed * 1_000_003 + k)  # fresh noise per step; a kernel, no copy
                self.decode(tok)
                tok, lp = (t.clone() for t in self.executor.sampled)  # the graph's buffers are reused
            else:
                tok, lp = sample(_guided(self.decode(tok), guides), sampling, gen, counts,
                                 eos_ban if k + 1 < min_tokens else None)
                _take(guides, tok)
                if counts is not None:
                    counts.add(rows, tok)
            toks.append(tok), lps.append(lp)
            if progress is not None:
                progress.update(1)
        sync()
        t2 = time.perf_counter()
        self.executor.check_errors()  # the mega executor: a wait that timed out inside a launch
        self._check_finite([len(p) for p in prompts], max_new_tokens)
        if self.parallel is not None and toks:
            self.parallel.check_same(torch.stack(toks, 1), "the generated tokens")
        ids = torch.stack(toks, 1).tolist() if toks else [[] for _ in prompts]
        lp_host = torch.stack(lps, 1).tolist() if lps else [[] for _ in prompts]
        eos = set(self.cfg.eos_token_id)
        if stop_at_eos and eos:
            for i, row in enumerate(ids):
                cut = next((j + 1 for j, t in enumerate(row) if t in eos), len(row))
                ids[i], lp_host[i] = row[:cut], lp_host[i][:cut]
        return GenerationResult(ids, lp_host, prefill_s=t1 - t0, decode_s=t2 - t1,
                                decode_steps=max(max_new_tokens - 1, 0), warmup_s=t0 - tw, warmup_steps=warm_steps)

    def _check_finite(self, prompt_lens: list[int], max_new_tokens: int) -> None:
        """Raise NonFiniteError naming the first sequence whose logits held NaN or inf, and the step."""
        first = self.executor.first_nonfinite[:len(prompt_lens)].tolist()
        bad = [(i, pos) for i, pos in enumerate(first) if pos >= 0]
        if not bad:
            return
        self.cache.clear()  # the failed steps wrote NaN/inf into the cache (KVCache.clear says why it matters)
        i, pos = bad[0]
        k = pos - prompt_lens[i] + 1  # the generated token these logits chose: 0 from the prefill's logits
        where = "the prefill" if k == 0 else f"decode step {k} of {max(max_new_tokens - 1, 0)}"
        others = f" ({len(bad) - 1} more sequences too)" if len(bad) > 1 else ""
        raise NonFiniteError(f"sequence {i}: the logits for generated token {k} ({where}, position {pos}) hold NaN "
                             f"or inf{others}; the weights may hold NaN or inf")


def _mtp_weights(cfg: ModelConfig, weights: dict[str, torch.Tensor], shard) -> dict[str, torch.Tensor] | None:
    """The MTP layer's tensors among `weights` (weights.mtp_specs; its `shared_head.head` may be left out), checked
    as the model's are, or None when `weights` hold none."""
    specs = mtp_specs(cfg)
    held = {n: weights[n] for n in specs if n in weights}
    if not held:
        return None
    if shard is not None:
        raise RequestError("the MTP layer's weights are for one process (no expert parallelism)")
    head = next(n for n in specs if n.endswith(".shared_head.head.weight"))
    check_weights(cfg, held, specs={n: s for n, s in specs.items() if n != head or n in held})
    return held


def _guided(logits: torch.Tensor, guides: list | None) -> torch.Tensor:
    """`logits` with each live guide's disallowed tokens masked (structured.apply_guides); as they are without."""
    if guides is None:
        return logits
    from .structured import apply_guides

    return apply_guides(logits, guides)


def _take(guides: list | None, tok: torch.Tensor) -> None:
    """Give each live guide its row's sampled token; a guide that took its stop token is dropped (its row is cut
    at that EOS at the end, whatever follows)."""
    if guides is None:
        return
    for i, t in enumerate(tok.tolist()):
        g = guides[i]
        if g is None:
            continue
        if not g.accept(t):
            raise RuntimeError(f"sequence {i}: sampled token {t} is not allowed by its guide (the mask was not "
                               "applied)")
        if g.done:
            guides[i] = None
