"""The model runner of continuous batching: runs the engine for the sequences the scheduler picked and makes no
policy (nano-vllm's ModelRunner).

- prefill: newcomers' prompts into their own cache slots (Engine.prefill_into: no other slot is written, so the
  running sequences keep their cache);
- decode: one token for each running sequence, at its own slot and position (Engine.decode_into); when the
  executor replays captured graphs, the batch is padded up to the next prepared size with rows in the scratch
  slot (the cache's last slot, never given to a request: token 0 at position 0, results dropped), so a batch
  whose size changes replays a graph captured at startup (`warmup`) and never captures mid-stream;
- sampling: per sequence (its own params and generator: sampling.sample_rows; a structured output guide's mask
  first, structured.py), with the tokens, logprobs and a finite flag per row brought to the host in one copy per
  step; the token counts penalties read are kept per slot
  on the device (sampling.Counts), counted from each step's sampled tokens there;
- a step is launched, then collected: the loop can launch the next decode step (fed on the device with this one's
  tokens) before it waits for this one's results, so the GPU does not wait for the host between steps;
- `mirror` (expert parallelism, serve/lockstep.py): told each prefill, decode step and slot clear before it runs,
  so that the other ranks run the same steps.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from .engine import Engine
from .sampling import Counts, to_device, sample_rows, top_logprobs
from .sequence import Sequence


@dataclass(eq=False)
class Launched:
    """A step whose kernels are queued: its sequences, the tokens it samples (on the device), its results (tokens,
    logprobs, finite flags, then K rows of the top tokens' ids and K of their logprobs, K the most any sequence
    asks for: [3 + 2K, B] float64, on the host once `done` has fired; None: already there)."""

    seqs: list[Sequence]
    tokens: torch.Tensor
    host: torch.Tensor
    done: object = None  # a torch.cuda.Event
    launched: float = 0.0  # perf_counter() when it was queued (the engine loop's step times)


def default_batch_sizes(max_batch: int) -> list[int]:
    """Powers of two below max_batch, and max_batch: 1, 2, 4, 8, 12 for 12 (vLLM pads to a similar ladder)."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return sizes + [max_batch]


def check_batch_sizes(sizes: list[int], max_batch: int) -> list[int]:
    if not sizes or any(isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= max_batch for b in sizes):
        raise ValueError(f"batch sizes must be integers in [1, {max_batch}] (--max-batch), got {sizes}")
    return sorted(set(sizes) | {max_batch})  # a full batch must have a size to run at


class ModelRunner:
    """`engine.cache` has one slot more than the sequences it serves: the last is the scratch slot of the
    padding rows. `pad`: pad decode batches to `batch_sizes` (default: when the executor replays captured graphs,
    since eager steps gain nothing by it)."""

    def __init__(self, engine: Engine, batch_sizes: list[int] | None = None, pad: bool | None = None, mirror=None):
        if engine.cache.num_slots < 2:
            raise ValueError("the model runner needs a cache of >= 2 slots (the last is its scratch slot)")
        self.engine = engine
        self.mirror = mirror
        self.max_batch = engine.cache.num_slots - 1
        self.scratch = self.max_batch
        self.batch_sizes = check_batch_sizes(batch_sizes or default_batch_sizes(self.max_batch), self.max_batch)
        self.pad = bool(engine.executor.graph_lengths(1, 1, 1)) if pad is None else pad
        self.device = engine.device
        self._kda = bool(engine.cache.state_layers)
        # step inputs (tokens, positions, slots) go to the device in one copy, from a pinned buffer on CUDA
        self._host = [torch.zeros(3, self.max_batch, dtype=torch.int64, pin_memory=self.device.type == "cuda")
                      for _ in range(2)]
        self._turn = 0
        self._dev = torch.zeros(3, self.max_batch, dtype=torch.int64, device=self.device)
        self.counts: Counts | None = None  # per slot, the token counts penalties read (made for the first one)

    def warmup(self, progress=None, drafter=None) -> int:
        """Compile and capture every decode graph serving can replay: each prepared batch size, at every cache
        length the executor distinguishes (Engine.warmup); with `drafter`, the verify steps' too where they run as
        captured decode steps (`verify_sizes`). Returns the number of graphs."""
        sizes = self.batch_sizes if self.pad else list(range(1, self.max_batch + 1))
        verify = self.verify_sizes(drafter) if drafter is not None and self.pads_verify(drafter) else []
        return self.engine.warmup(sizes, 1, self.engine.max_seq_len, slot=self.scratch, verify_sizes=verify,
                                  progress=progress)

    def padded(self, batch: int) -> int:
        return self.batch_sizes[bisect.bisect_left(self.batch_sizes, batch)] if self.pad else batch

    def pads_verify(self, drafter) -> bool:
        """Whether verify steps with `drafter` replay captured graphs, and are padded for it: decode steps are
        (`pad`) and the verify step runs as a decode step of its rows (speculative.run_verify)."""
        from .speculative import verifies_as_decode

        return self.pad and not drafter.reads_hidden and verifies_as_decode(self.engine)

    def verify_sizes(self, drafter) -> list[int]:
        """The row counts verify steps are padded to (`pads_verify`): a step of up to max_batch sequences feeds each
        its last token and up to drafter.k drafts, so the prepared batch sizes and the powers of two up to
        max_batch x (k + 1), and that. Each is warmed (`warmup`): a verify step never captures mid-stream."""
        return sorted(set(self.batch_sizes) | set(default_batch_sizes(self.max_batch * (drafter.k + 1))))

    # ---- steps ---------------------------------------------------------------------------------------------------
    # A step is launched (its kernels queued, the copy of its results to the host queued after them) and collected
    # later (waiting for that copy only). Between the two the host can launch the next decode step, fed on the
    # device with this one's tokens (`after`): the loop keeps the GPU busy while it handles the last step's tokens.

    @torch.inference_mode()
    def launch_prefill(self, seqs: list[Sequence], drafter=None) -> Launched:
        """Prefill each sequence's prompt into its slot; the step's results are its first new token. Sequences with
        the same prompt (a request's n choices) share one prefill: the first one's slot is computed and copied
        into the others' (not under expert parallelism, whose other ranks replay the prefills as published).
        `drafter` (one that reads hidden states: speculative.MtpDrafter): given each sequence's prompt hidden
        states and first token (`observe`)."""
        first: dict[tuple, int] = {}
        if self.mirror is None:
            for i, s in enumerate(seqs):
                first.setdefault(tuple(s.prompt), i)
        run = sorted(first.values()) if first else list(range(len(seqs)))
        prompts, slots = [seqs[i].prompt for i in run], [seqs[i].slot for i in run]
        if self.mirror is not None:
            self.mirror.prefill(prompts, slots)
        hidden = [] if drafter is not None and drafter.reads_hidden else None
        logits = self._published(self.engine.prefill_into, prompts, slots, *([] if hidden is None else [hidden]))
        src = list(range(len(seqs)))
        if len(run) < len(seqs):
            row = {i: r for r, i in enumerate(run)}
            src = [row[first[tuple(s.prompt)]] for s in seqs]
            for s, r in zip(seqs, src):
                if s.slot != slots[r]:
                    self.engine.cache.copy_slot(slots[r], s.slot, len(s.prompt))
            logits = logits[torch.tensor(src, device=logits.device)]
        launched = self._sample(logits, seqs)
        if hidden:
            at = [sum(map(len, prompts[:r])) for r in range(len(prompts))]
            drafter.observe([(s.slot, 0, hidden[0][at[r]:at[r] + len(s.prompt)],
                              torch.cat((to_device(s.prompt[1:], torch.int64, self.device), launched.tokens[j:j + 1])))
                             for j, (s, r) in enumerate(zip(seqs, src))])
        return launched

    @torch.inference_mode()
    def launch_decode(self, seqs: list[Sequence], after: Launched | None = None) -> Launched:
        """One decode step of `seqs`: each feeds its last token at position num_tokens - 1, or, with `after` (a
        step of the same sequences not collected yet), the token `after` sampled, read on the device, at position
        num_tokens."""
        B = len(seqs)
        P = self.padded(B)
        if P > self.max_batch:
            raise ValueError(f"{B} sequences exceed the {self.max_batch} the cache holds")
        if after is not None and after.seqs != seqs:
            raise ValueError("a step can follow an uncollected step of the same sequences only")
        clear = P > B and self._kda
        if clear:  # padding rows race on the scratch slot's recurrent state: keep it at zero
            self.engine.cache.clear_slot(self.scratch, state_only=True)
        shift = 0 if after is None else 1
        rows = [[s.last_token for s in seqs], [s.num_tokens - 1 + shift for s in seqs], [s.slot for s in seqs]]
        # two staging buffers, used in turn: the copy from the other one may still be queued (its step was launched
        # but not collected), this one's step was collected, so its copy is done
        self._turn ^= 1
        host = self._host[self._turn][:, :P]
        host[:, :B] = torch.tensor(rows, dtype=torch.int64)
        host[:, B:] = torch.tensor([[0], [0], [self.scratch]], dtype=torch.int64)
        dev = self._dev[:, :P]
        dev.copy_(host, non_blocking=True)
        if after is not None:
            dev[0, :B].copy_(after.tokens)
        kv_len = max(rows[1]) + 1
        if self.mirror is not None:
            dev = self.mirror.decode(dev, kv_len, clear)
        logits = self._published(self.engine.decode_into, dev[0], dev[1], dev[2], kv_len=kv_len)
        return self._sample(logits[:B], seqs)

    def _published(self, fn, *args, **kw):
        """A step the mirror was told of: if it fails here, the mirror decides (serve/lockstep.py: the ranks are out
        of step, serving stops)."""
        try:
            return fn(*args, **kw)
        except Exception as e:
            if self.mirror is None:
                raise
            self.mirror.lost(e)
            raise

    def collect(self, step: Launched) -> list[tuple[int, float, bool, tuple]]:
        """(token, logprob, finite, top) per sequence of a launched step, top its `top_logprobs` most likely tokens
        as (id, logprob) pairs, most likely first; waiting for the copy to the host only (an event wait that
        releases the GIL, so the server's HTTP thread runs meanwhile)."""
        if step.done is not None:
            step.done.synchronize()
        rows = step.host.tolist()
        t, lp, ok = rows[:3]
        k = (len(rows) - 3) // 2
        ids, tops = rows[3:3 + k], rows[3 + k:]
        return [(int(t[i]), lp[i], ok[i] > 0,
                 tuple((int(ids[j][i]), tops[j][i]) for j in range(min(s.top_logprobs, k))))
                for i, s in enumerate(step.seqs)]

    def prefill(self, seqs: list[Sequence], drafter=None) -> list[tuple[int, float, bool, tuple]]:
        return self.collect(self.launch_prefill(seqs, drafter))

    def decode(self, seqs: list[Sequence]) -> list[tuple[int, float, bool, tuple]]:
        return self.collect(self.launch_decode(seqs))

    @torch.inference_mode()
    def verify(self, seqs: list[Sequence], drafter) -> tuple[list[list[tuple[int, float, bool, tuple]]], int, int]:
        """One speculative step (speculative.py): each sequence that may take drafts (no penalties, logit bias,
        structured output guide, top logprobs, or min_tokens still to go) feeds its last token and up to k tokens of
        `drafter`'s at their positions, the others their last token alone, all in one step (speculative.run_verify:
        a decode step of the fed tokens where the executor and model allow, its captured graph replayed; else the
        executor's prefill ops, eagerly); a drafted sequence keeps the drafts it accepts (greedy: its argmax;
        sampling: the rejection rule) and one token of the model's, the others sample as in a decode step. Returns,
        per sequence, its new tokens as `collect` gives them, and the draft tokens proposed and accepted.
        Synchronous: no step launched ahead. A drafter that reads hidden states (speculative.MtpDrafter) is given
        every sequence's kept positions' (`observe`)."""
        from .speculative import accept, rewind_states, run_verify

        self._generators(seqs)
        takes = [i for i, s in enumerate(seqs) if not s.params.penalized and not s.params.logit_bias
                 and s.guide is None and not s.top_logprobs and s.sampled >= s.min_tokens]
        drafts = dict(zip(takes, drafter.draft_many([seqs[i].prompt + seqs[i].output for i in takes],
                                                    [seqs[i].slot for i in takes])))
        feeds = []
        for i, s in enumerate(seqs):
            room = min(s.max_tokens - len(s.output) - 1, self.engine.max_seq_len - s.num_tokens)
            feeds.append([s.last_token] + drafts.get(i, [])[:max(min(room, drafter.k), 0)])
        dev = self.device
        firsts, slots, pad = [s.num_tokens - 1 for s in seqs], [s.slot for s in seqs], []
        if self.pads_verify(drafter):  # up to a warmed row count: rows of token 0 at position 0 of the scratch slot
            sizes = self.verify_sizes(drafter)
            rows = sum(map(len, feeds))
            pad = [[0]] * (sizes[bisect.bisect_left(sizes, rows)] - rows)
        step, starts, logits, h = run_verify(self.engine, feeds + pad, firsts + [0] * len(pad),
                                             slots + [self.scratch] * len(pad), hidden=drafter.reads_hidden,
                                             call=self._published)
        results: list = [None] * len(seqs)
        plain = [i for i, f in enumerate(feeds) if len(f) == 1]
        if plain:  # no drafts: the decode step's sampling (penalties, bias, guides, bans, top logprobs)
            rows = torch.tensor([starts[i] for i in plain], device=dev)
            for i, r in zip(plain, self.collect(self._sample(logits[rows], [seqs[i] for i in plain]))):
                results[i] = [r]
        drafted = accepted = 0
        kept = {}
        for i, (s, f, st) in enumerate(zip(seqs, feeds, starts)):
            if len(f) == 1:
                continue
            rows = logits[st:st + len(f)].float()
            if not bool(torch.isfinite(rows).all()):
                results[i] = [(0, 0.0, False, ())]
                continue
            emit, lps = accept(rows, f, s.params, s.generator)
            kept[i] = len(emit)  # KDA state: back to after the last token and the accepted drafts
            drafted += len(f) - 1
            accepted += len(emit) - 1
            s.sampled += len(emit)
            results[i] = [(t, lp, True, ()) for t, lp in zip(emit, lps)]
        rewind_states(step, kept)
        if drafter.reads_hidden:
            done = [(s, st, [t for t, _, ok, _ in r]) for s, st, r in zip(seqs, starts, results) if r[-1][2]]
            drafter.observe([(s.slot, s.num_tokens - 1, h[st:st + len(e)], to_device(e, torch.int64, self.device))
                             for s, st, e in done])
        return results, drafted, accepted

    def _generators(self, seqs: list[Sequence]) -> None:
        """Each sampled sequence's generator, made at its first draw (seeded, or a fresh random seed)."""
        for s in seqs:
            if s.generator is None and not s.params.greedy:
                g = torch.Generator(device=self.device)
                s.generator = g.manual_seed(s.seed) if s.seed is not None else g
                if s.seed is None:
                    g.seed()  # a fresh random seed: OpenAI's requests without one are not reproducible

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> Launched:
        self._generators(seqs)
        pen = [i for i, s in enumerate(seqs) if s.params.penalized]
        if pen:  # counted on the device per slot, so a step launched before the last one was read sees its token
            if self.counts is None:
                self.counts = Counts(self.engine.cache.num_slots, self.engine.cfg.vocab_size, self.device)
            new = [seqs[i] for i in pen if not seqs[i].counted]  # their first token: counts from the prompt
            if new:
                self.counts.start([s.slot for s in new], [s.prompt for s in new])
                for s in new:
                    s.counted = True
        finite = torch.isfinite(logits).all(-1)  # of the model's logits (a guide's mask puts -inf in them)
        if any(s.guide is not None for s in seqs):  # structured output: the tokens each guide allows
            from .structured import apply_guides

            logits = apply_guides(logits, [s.guide for s in seqs])
        ban = [s.stop_ids if s.sampled < s.min_tokens else () for s in seqs]  # min_tokens: no stop id yet
        tokens, logprobs = sample_rows(logits, [s.params for s in seqs], [s.generator for s in seqs], self.counts,
                                       [s.slot for s in seqs], ban)
        for s in seqs:
            s.sampled += 1
        if pen:
            idx = to_device(pen, torch.int64, self.device)
            self.counts.add(to_device([seqs[i].slot for i in pen], torch.int64, self.device), tokens[idx])
        out = torch.stack((tokens.double(), logprobs.double(), finite.double()))  # token ids < 2**53: exact
        k = max(s.top_logprobs for s in seqs)
        if k:
            vals, ids = top_logprobs(logits, k)
            out = torch.cat((out, ids.T.double(), vals.T.double()))
        if self.device.type != "cuda":
            return Launched(seqs, tokens, out, None)
        host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)  # pinned: the copy does not block
        host.copy_(out, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return Launched(seqs, tokens, host, done)

    def clear(self, slot: int) -> None:
        """Zero a slot whose sequence failed (its cache may hold NaN or inf: KVCache.clear)."""
        if self.mirror is not None:
            self.mirror.clear(slot)
        self.engine.cache.clear_slot(slot)

