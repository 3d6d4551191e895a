"""Speculative decoding: a drafter proposes up to k next tokens per sequence, one step of the target model
verifies them all, and the accepted drafts are kept with one more token of the target's (a correction, or a bonus
token when every draft was accepted): a step that accepts m drafts produces m + 1 tokens.

Greedy: a draft is accepted while it is the target's own argmax, so the output is the target's greedy output.
Sampling (`accept_drafts`): the rejection rule of speculative sampling (Leviathan et al.; Chen et al.) for a
drafter that proposes fixed tokens (probability 1 to its draft): draft d is accepted with probability p(d), p the
target's distribution at that position (after temperature, min-p, top-k, top-p); the first rejected one is
replaced by a draw from p with d removed, renormalised; when all are accepted the bonus token is drawn from p at
the last position. Each emitted token is then distributed as the target's sampler would draw it.

The verify step feeds each sequence its last token and its drafts at their positions and takes the logits of every
position (`run_verify`). Where the executor and model allow (`verifies_as_decode`: no KDA layers, and not the
megakernel's GQA layers) it is a decode step of all the fed tokens, a row per token: each row writes its cache entry
before any row reads the cache, and attends to the positions up to its own, so the step is causal within a sequence; on
CUDA the executor's captured decode graph of that many rows replays it (`fused`: its kernels). Otherwise it is a prefill
step of segments that continue the sequences' caches, run eagerly by the executor's prefill ops. Drafts the target
rejects leave cache entries past the sequence's length, which the next step overwrites before any query can see them
(attention is masked by position). Models with a recurrent state (KDA layers: kimi_linear, kimi_k3) continue it from the
slot's state (`Step.seg_first`) and record the state after each fed token (`Step.state_trace`); the state after the
accepted prefix is put back (`rewind_states`), so rejected drafts leave no trace in it. The record is transient: per KDA
layer and sequence, k + 1 copies of the recurrent state (H x K x K fp32) and of the conv's window.

Drafters: `NgramDrafter`, prompt lookup (vLLM's `ngram`): no weights, drafts from text the sequence repeats;
`DraftModelDrafter`, a smaller model of the same vocabulary (`--draft-model`): its greedy continuation;
`MtpDrafter`, the model's own multi-token-prediction layer (DeepSeek-V3's, mtp.py), fed the target's last hidden
states (`Drafter.observe`); `OracleDrafter`, recorded continuations (benchmarks: every draft accepted).
"""

from __future__ import annotations

import operator
import time
import dataclasses
from dataclasses import dataclass

import torch

from .engine import Engine, NonFiniteError, RequestError
from .plan import ATTN_KDA, final_norm_input
from .sampling import SamplingParams, race, sample, target_probs
from .step import Step

MAX_DRAFT = 7  # draft tokens a step at most (issue 43: k up to 7)


class Drafter:
    """What proposes drafts. `draft`: up to k proposed next tokens of the sequence `tokens` (prompt and output so
    far), [] for none; `draft_many`: each of a step's sequences' (one at a time, unless a drafter batches them),
    `slots` their cache slots in the target (read by drafters that keep state per sequence). `k`: the most drafts a
    sequence gets a step (set by each drafter; a server sizes its verify steps by it, ModelRunner.verify_sizes).
    `reads_hidden`: the drafter drafts from the target's last hidden states, which the caller gives it after each
    step of the target (`observe`)."""

    reads_hidden = False

    def draft(self, tokens: list[int]) -> list[int]:
        raise NotImplementedError

    def draft_many(self, seqs: list[list[int]], slots: list[int] | None = None) -> list[list[int]]:
        return [self.draft(s) for s in seqs]

    def observe(self, pieces: list[tuple[int, int, torch.Tensor, torch.Tensor]]) -> None:
        """After a step of the target (prefill or verify), for drafters that read hidden states: per sequence
        (slot, first, hidden [m, D], next [m]): the tokens it kept at positions first .. first + m - 1 (the
        prompt; or the fed token and the accepted drafts), their last layer's outputs (the final norm's input), and
        each one's next token (the prompt's next, then the sampled one; the accepted drafts, then the correction or
        bonus). Its drafts after that step extend exactly that sequence."""


class NgramDrafter(Drafter):
    """Prompt lookup: the longest n-gram (n from max_n down to min_n) that ends the sequence and occurred earlier in
    it; the draft is the (up to) k tokens that followed its latest earlier occurrence. None found: no draft."""

    def __init__(self, k: int, max_n: int = 4, min_n: int = 1):
        if not 1 <= k <= MAX_DRAFT:
            raise RequestError(f"draft tokens must be in [1, {MAX_DRAFT}], got {k}")
        if not 1 <= min_n <= max_n:
            raise RequestError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.k, self.max_n, self.min_n = k, max_n, min_n

    def draft(self, tokens: list[int]) -> list[int]:
        """Every earlier start of each n-gram compared at once (vectorized over the sequence): a Python loop over
        the starts took 4 ms a draft at 8000 tokens without a match on a 2-core CPU, a decode step's time."""
        L = len(tokens)
        top = min(self.max_n, L - 1)
        if top < self.min_n:
            return []
        t = torch.as_tensor(tokens, dtype=torch.int64)
        for n in range(top, self.min_n - 1, -1):
            m = L - n  # earlier starts 0 .. m - 1 (the tail itself starts at m)
            hit = t[:m] == t[m]
            for j in range(1, n):
                hit &= t[j:m + j] == t[m + j]
            at = hit.nonzero()
            if len(at):
                s = int(at[-1])  # the latest earlier occurrence
                return tokens[s + n:s + n + self.k]
        return []


def accept_drafts(probs: torch.Tensor, drafts: list[int], u: list[float], noise: torch.Tensor) -> list[int]:
    """The tokens a sampled verify step emits for one sequence: probs [k + 1, V] the target's distributions after
    each fed token (its last token, then the k drafts), u k uniforms in [0, 1), noise [V] ~ Exp(1) for the one
    draw. The accepted drafts, then the correction (p at the first rejection, the draft removed) or the bonus
    (p after the last draft)."""
    k = len(drafts)
    pd = probs[torch.arange(k, device=probs.device), torch.tensor(drafts, device=probs.device)].tolist() if k else []
    m = 0
    while m < k and u[m] < pd[m]:
        m += 1
    p = probs[m]
    if m < k:
        p = p.clone()
        p[drafts[m]] = 0.0
    return drafts[:m] + [int(race(p[None], noise[None])[0])]


class OracleDrafter(Drafter):
    """Drafts from known continuations (a benchmark's upper bound of the verify path: each full sequence recorded
    from an earlier greedy run, so every draft is accepted): the next k tokens of the recorded sequence the current
    one is a prefix of; none when it is a prefix of none."""

    def __init__(self, k: int, sequences: list[list[int]]):
        if not 1 <= k <= MAX_DRAFT:
            raise RequestError(f"draft tokens must be in [1, {MAX_DRAFT}], got {k}")
        self.k, self.sequences = k, [list(s) for s in sequences]

    def draft(self, tokens: list[int]) -> list[int]:
        n = len(tokens)
        for s in self.sequences:
            if len(s) > n and s[:n] == tokens:
                return s[n:n + self.k]
        return []


class DraftModelDrafter(Drafter):
    """Drafts by a second, smaller model of the target's vocabulary (speculative decoding's classic drafter): the
    draft engine's greedy continuation of each sequence, k tokens. The draft engine keeps one cache slot per
    sequence it drafts for, found by the longest common prefix of the tokens the slot's cache holds with the
    sequence (the least recently used free slot when none shares one). A step's sequences are drafted together
    (`draft_many`): one step feeds each the tokens past its slot's prefix (the previous step's accepted drafts and
    the target's token), continuing the slot's cache, then k - 1 steps feed each its last draft. Entries past the
    prefix are left in the cache; the step that feeds those positions overwrites them before any query can see
    them (attention is masked by position). Steps run the draft executor's prefill ops (`run_ops`), eager."""

    def __init__(self, engine: Engine, k: int, vocab_size: int):
        if not 1 <= k <= MAX_DRAFT:
            raise RequestError(f"draft tokens must be in [1, {MAX_DRAFT}], got {k}")
        check_draft_model(engine.cfg, vocab_size)
        if engine.parallel is not None:
            raise RequestError("the draft model runs in one process (no expert parallelism)")
        self.engine, self.k = engine, k
        n = engine.cache.num_slots
        self.held: list[list[int]] = [[] for _ in range(n)]  # the tokens whose entries each slot's cache holds
        self.last_use = [0] * n
        self.clock = 0

    def _slot(self, tokens: list[int], taken: set[int]) -> tuple[int, int]:
        """(slot, prefix length) for the sequence among the slots not `taken`: the one sharing its longest prefix,
        else the least recently used one (prefix 0)."""
        best, best_n = None, 0
        for s, h in enumerate(self.held):
            if s in taken:
                continue
            n = 0
            for a, b in zip(h, tokens):
                if a != b:
                    break
                n += 1
            if n > best_n:
                best, best_n = s, n
        if best is None:
            best = min((s for s in range(len(self.held)) if s not in taken), key=self.last_use.__getitem__)
        return best, best_n

    def _step(self, pieces: list[tuple[list[int], int, int]]) -> torch.Tensor:
        """One step feeding each (tokens, first position, slot) piece at its positions of its slot's cache; the
        next-token logits after each piece's last token [len(pieces), V]."""
        dev = self.engine.device
        lens = [len(f) for f, _, _ in pieces]
        starts = [sum(lens[:j]) for j in range(len(lens))]
        step = Step(tokens=torch.tensor([t for f, _, _ in pieces for t in f], device=dev),
                    positions=torch.cat([torch.arange(p, p + len(f)) for f, p, _ in pieces]).to(dev),
                    slots=torch.cat([torch.full((len(f),), s) for f, _, s in pieces]).to(dev),
                    logit_rows=torch.tensor([st + n - 1 for st, n in zip(starts, lens)], device=dev),
                    kv_len=max(p + len(f) for f, p, _ in pieces),
                    segments=[(st, st + len(f), s) for st, (f, _, s) in zip(starts, pieces)])
        return self.engine.executor.run_ops(step).buf["logits"]

    def draft(self, tokens: list[int]) -> list[int]:
        return self.draft_many([tokens])[0]

    @torch.inference_mode()
    def draft_many(self, seqs: list[list[int]], slots: list[int] | None = None) -> list[list[int]]:
        """Each sequence's drafts, the sequences' steps run together (at most as many sequences a group as the
        draft engine has cache slots; the draft engine's slots are its own, the target's `slots` unused)."""
        out: list[list[int]] = [[] for _ in seqs]
        live = [i for i, q in enumerate(seqs) if min(self.k, self.engine.max_seq_len - len(q)) > 0]
        n = len(self.held)
        for g in range(0, len(live), n):
            self._draft_group(seqs, live[g:g + n], out)
        return out

    def _draft_group(self, seqs: list[list[int]], idx: list[int], out: list[list[int]]) -> None:
        taken: set[int] = set()
        held, slots, ks, pieces = {}, {}, {}, []
        for i in idx:
            tokens = [operator.index(t) for t in seqs[i]]
            slot, common = self._slot(tokens, taken)
            common = min(common, len(tokens) - 1)  # at least the last token is fed: its logits are the first draft's
            taken.add(slot)
            self.clock += 1
            self.last_use[slot] = self.clock
            self.held[slot] = tokens[:common]  # kept if a step below raises
            held[i], slots[i], ks[i] = tokens, slot, min(self.k, self.engine.max_seq_len - len(tokens))
            pieces.append((tokens[common:], common, slot))
        logits = self._step(pieces)
        rows = dict(zip(idx, range(len(idx))))
        for r in range(max(ks.values())):
            fed = []
            for i in list(rows):
                lg = logits[rows[i]]
                if not bool(torch.isfinite(lg).all()):  # a draft from NaN logits would be noise: propose what there is
                    del rows[i]
                    continue
                t = int(lg.argmax())
                out[i].append(t)
                if r + 1 < ks[i]:
                    fed.append(i)
                else:
                    del rows[i]
            if not fed:
                break
            logits = self._step([([out[i][-1]], len(held[i]), slots[i]) for i in fed])
            for j, i in enumerate(fed):
                held[i].append(out[i][-1])
                rows[i] = j
        for i in idx:
            self.held[slots[i]] = held[i]


def draft_model_drafter(model: str, k: int, vocab_size: int, *, device, dtype: str, seed: int, max_batch: int,
                        max_seq_len: int | None) -> DraftModelDrafter:
    """`--draft-model`'s drafter for a target of `vocab_size` tokens: the model (a preset with seed `seed`'s random
    weights, or a checkpoint) built on the target's device, checked first, with the graph executor on CUDA (its
    eager prefill ops) and the torch one on the CPU; `max_batch` sequences (cache slots) of `max_seq_len`."""
    from .engine import model_config

    check_draft_model(model_config(model), vocab_size)
    executor = "graph" if torch.device(device).type == "cuda" else "torch"
    draft = Engine.from_pretrained(model, device=device, dtype=dtype, seed=seed, executor=executor,
                                   max_batch=max_batch, max_seq_len=max_seq_len)
    return DraftModelDrafter(draft, k, vocab_size)


class MtpDrafter(Drafter):
    """Drafts by the model's multi-token-prediction layer (mtp.py), held by `engine` (Engine.mtp_weights), with a
    cache of the target's slots and positions. After each step of the target (`observe`) the layer runs over the
    positions the sequence kept, each with its next token: that writes their entries of its cache (over what
    earlier drafts wrote there) and gives, at the last, the first draft and the layer's output. `draft_many` chains
    the layer from there, k - 1 steps of one token a sequence at the positions that follow (their entries are
    written over by the next `observe` before any query of the layer can see them: its attention is masked by
    position). A sequence is drafted for only when the last `observe` of its slot left it at its length. Greedy:
    each draft is the argmax of the layer's logits; from non-finite logits no further draft is proposed."""

    reads_hidden = True

    def __init__(self, engine: Engine, k: int):
        from .mtp import MtpLayer, mtp_refusal

        if not 1 <= k <= MAX_DRAFT:
            raise RequestError(f"draft tokens must be in [1, {MAX_DRAFT}], got {k}")
        why = mtp_refusal(engine.cfg)
        if why:
            raise RequestError(why)
        if engine.parallel is not None:
            raise RequestError("the MTP drafter runs in one process (no expert parallelism)")
        if engine.mtp_weights is None:
            raise RequestError("the engine holds no MTP layer weights (build it with Engine.from_pretrained(..., "
                               "mtp=True), or give Engine the MTP layer's tensors)")
        w = engine.executor.weights
        embed = "model.embed_tokens.weight"
        head = w[embed if engine.cfg.tie_word_embeddings else "lm_head.weight"]
        self.layer = MtpLayer(engine.cfg, {**engine.mtp_weights, embed: w[embed]}, head, engine.cache.num_slots,
                              engine.max_seq_len)
        self.k, self.max_len, self.device = k, engine.max_seq_len, engine.device
        # per target slot: (the sequence's length, its first draft [1], the layer's output at its last kept position
        # [1, D], whether the logits of that draft were finite [1]), on the device
        self.ready: dict[int, tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    @torch.inference_mode()
    def observe(self, pieces: list[tuple[int, int, torch.Tensor, torch.Tensor]]) -> None:
        pieces = [p for p in pieces if len(p[2])]
        if not pieces:
            return
        dev = self.device
        lens = [len(h) for _, _, h, _ in pieces]
        starts = [sum(lens[:j]) for j in range(len(lens))]
        step = Step(tokens=torch.cat([torch.as_tensor(nx, device=dev).long() for _, _, _, nx in pieces]),
                    positions=torch.cat([torch.arange(p, p + m) for (_, p, _, _), m in zip(pieces, lens)]).to(dev),
                    slots=torch.cat([torch.full((m,), s) for (s, _, _, _), m in zip(pieces, lens)]).to(dev),
                    logit_rows=torch.tensor([st + m - 1 for st, m in zip(starts, lens)], device=dev),
                    kv_len=max(p + m for (_, p, _, _), m in zip(pieces, lens)),
                    segments=[(st, st + m, s) for st, m, (s, _, _, _) in zip(starts, lens, pieces)])
        out, logits = self.layer(step, torch.cat([h for _, _, h, _ in pieces]))
        tok, ok = logits.argmax(-1), torch.isfinite(logits).all(-1)
        for j, ((s, p, _, _), m, st) in enumerate(zip(pieces, lens, starts)):
            self.ready[s] = (p + m + 1, tok[j:j + 1], out[st + m - 1:st + m], ok[j:j + 1])

    @torch.inference_mode()
    def draft_many(self, seqs: list[list[int]], slots: list[int] | None = None) -> list[list[int]]:
        if slots is None or len(slots) != len(seqs):
            raise ValueError("the MTP drafter drafts for sequences by their cache slots: give draft_many `slots`")
        out: list[list[int]] = [[] for _ in seqs]
        rows = [i for i, (q, s) in enumerate(zip(seqs, slots)) if s in self.ready
                and self.ready[s][0] == len(q) and self.max_len > len(q)]
        if not rows:
            return out
        ks = [min(self.k, self.max_len - len(seqs[i])) for i in rows]  # the layer's positions stay in its cache
        ready = [self.ready[slots[i]] for i in rows]
        toks, hs = torch.cat([r[1] for r in ready]), torch.cat([r[2] for r in ready])
        drafts, finite = [toks], [torch.cat([r[3] for r in ready])]
        dev = self.device
        for r in range(1, max(ks)):
            live = torch.tensor([j for j, kj in enumerate(ks) if kj > r], device=dev)
            pos = torch.tensor([len(seqs[i]) - 2 + r for i, kj in zip(rows, ks) if kj > r], device=dev)
            step = Step(tokens=drafts[-1][live], positions=pos,
                        slots=torch.tensor([slots[i] for i, kj in zip(rows, ks) if kj > r], device=dev),
                        logit_rows=torch.arange(len(live), device=dev), kv_len=int(pos.max()) + 1)
            h, logits = self.layer(step, hs[live])
            nxt, ok = torch.zeros_like(toks), torch.zeros_like(finite[0])
            nxt[live], ok[live] = logits.argmax(-1), torch.isfinite(logits).all(-1)
            hs = hs.index_copy(0, live, h)
            drafts.append(nxt)
            finite.append(ok)
        got, fine = torch.stack(drafts, 1).tolist(), torch.stack(finite, 1).tolist()
        for j, (i, kj) in enumerate(zip(rows, ks)):
            n = next((r for r in range(kj) if not fine[j][r]), kj)
            out[i] = got[j][:n]
        return out


@dataclass
class SpeculativeResult:
    token_ids: list[list[int]]
    logprobs: list[list[float]]  # each token's log-probability under the target (greedy: its most likely token)
    steps: int  # verify steps (the prefill's first token not counted)
    drafted: int  # draft tokens proposed, over all sequences and steps
    accepted: int  # of them, kept
    prefill_s: float
    decode_s: float

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after each sequence's first (the prefill's) over the verify steps' time."""
        made = sum(max(len(t) - 1, 0) for t in self.token_ids)
        return made / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def tokens_per_step(self) -> float:
        """New tokens per sequence and verify step (1 without speculation)."""
        made = sum(max(len(t) - 1, 0) for t in self.token_ids)
        return made / self.steps / max(len(self.token_ids), 1) if self.steps else 0.0


def check_draft_model(cfg, vocab_size: int) -> None:
    """RequestError for a draft model that cannot draft for a target of `vocab_size` tokens: another vocabulary,
    or a recurrent state (KDA) that a rejected draft would advance."""
    if cfg.vocab_size != vocab_size:
        raise RequestError(f"the draft model's vocabulary has {cfg.vocab_size} tokens, the target's {vocab_size}: "
                           "a draft model must share the target's tokenizer")
    if any(cfg.is_kda(i) for i in range(cfg.num_layers)):
        raise RequestError(f"a {cfg.family} draft model is not taken: its KDA layers' recurrent state would advance "
                           "over drafts (qwen3_moe and deepseek_v3 draft models are)")


def check_speculative(engine: Engine) -> None:
    if engine.parallel is not None:
        raise RequestError("speculative decoding runs in one process (no expert parallelism)")


def verify_step(feeds: list[list[int]], first: list[int], slots: list[int], device) -> tuple[Step, list[int]]:
    """The verify step of sequences feeding feeds[i] (their last token, then their drafts) at positions first[i]
    onwards in cache slots slots[i], every row's logits wanted; and each feed's first row in it. Each segment
    continues its slot's sequence (`seg_first`), and KDA layers record their state after each fed token
    (`state_trace`, for `rewind_states`)."""
    lens = [len(f) for f in feeds]
    starts = [sum(lens[:j]) for j in range(len(lens))]
    step = Step(tokens=torch.tensor([t for f in feeds for t in f], device=device),
                positions=torch.cat([torch.arange(p, p + n) for p, n in zip(first, lens)]).to(device),
                slots=torch.cat([torch.full((n,), s) for s, n in zip(slots, lens)]).to(device),
                logit_rows=torch.arange(sum(lens), device=device), kv_len=max(p + n for p, n in zip(first, lens)),
                segments=[(st, st + n, s) for st, n, s in zip(starts, lens, slots)], seg_first=list(first),
                state_trace=[])
    return step, starts


def verifies_as_decode(engine: Engine) -> bool:
    """Whether the verify step runs as a decode step of its fed tokens (`run_verify`): the executor's decode step
    writes all of a step's cache entries before any row reads the cache (ExecutorBase.decode_verifies; the
    megakernel's program for Step.causal_rows), and no layer carries a recurrent state from one of the step's
    tokens to the next (KDA layers: kimi_linear, kimi_k3, whose decode step advances a slot's state once)."""
    return engine.executor.decode_verifies and not any(op.kind == ATTN_KDA for op in engine.plan.ops)


def run_verify(engine: Engine, feeds: list[list[int]], first: list[int], slots: list[int], *, hidden: bool = False,
               call=None) -> tuple[Step, list[int], torch.Tensor, torch.Tensor | None]:
    """The verify step of sequences feeding feeds[i] at positions first[i] onwards in cache slots slots[i] (as
    verify_step's), run by the engine's executor. Returns (the step, each feed's first row, the logits of every
    row [rows, V] fp32, and with `hidden` the last layer's output of every row [rows, D], else None).
    Where `verifies_as_decode` and no hidden states are wanted, the step is a decode step of all the fed tokens
    (a row per token: its slot, its position; the executor's captured decode graph of that many rows, its fused
    kernels): each row writes its cache entry, then attends to positions up to its own, which the earlier rows of
    its sequence wrote in the same step. Otherwise the executor's prefill ops run it eagerly (segments that
    continue the slots' sequences, KDA's state recorded per token). The decode form's logits may be the captured
    graph's output buffer: read them before the next step. `call(fn, step)`: how to run the executor's method (the
    runner's publishing wrapper); default fn(step)."""
    call = call or (lambda fn, st: fn(st))
    step, starts = verify_step(feeds, first, slots, engine.device)
    if not hidden and verifies_as_decode(engine):  # the same rows as a decode step: no segments, no state record;
        # the rows continue their sequences, so a program that writes a row's cache entry in the phase other rows
        # read it (the megakernel's GQA attention) takes its causal-rows form (Step.causal_rows)
        step = dataclasses.replace(step, segments=None, seg_first=None, state_trace=None, causal_rows=True)
        return step, starts, call(engine.executor.decode, step), None
    ctx = call(engine.executor.run_ops, step)
    return step, starts, ctx.buf["logits"], ctx.buf[final_norm_input(engine.plan)] if hidden else None


def rewind_states(step: Step, kept: dict[int, int]) -> None:
    """After a verify step: the KDA state of segment j put back to what it was after the first kept[j] tokens
    it fed (its last token and the drafts it accepted); segments not named, or that kept every token, stay."""
    for tr in step.state_trace or ():
        n = kept.get(tr.segment)
        if n is not None and n < tr.rec.shape[0]:
            tr.rewind(n)


def accept(logits: torch.Tensor, feed: list[int], params: SamplingParams, generator) -> tuple[list[int], list[float]]:
    """The tokens a verify step emits for one sequence, from its rows of logits [len(feed), V] (the target's after
    each fed token), and their log-probabilities at temperature 1. Greedy: the drafts while they are the target's
    argmax, then its argmax; sampling (no penalties or bias): `accept_drafts`, its uniforms and noise drawn from
    `generator`."""
    logp = torch.log_softmax(logits.float(), -1)
    if params.greedy:
        choice = logp.argmax(-1).tolist()
        m = 0
        while m < len(feed) - 1 and feed[m + 1] == choice[m]:
            m += 1
        emit = choice[:m + 1]  # the accepted drafts are the target's tokens
    else:
        u = torch.rand(len(feed) - 1, generator=generator, device=logits.device).tolist()
        noise = torch.empty(logits.shape[-1], device=logits.device).exponential_(1.0, generator=generator)
        emit = accept_drafts(target_probs(logits, params), feed[1:], u, noise)
    idx = torch.arange(len(emit), device=logits.device)
    return emit, logp[idx, torch.tensor(emit, device=logits.device)].tolist()


@torch.inference_mode()
def generate(engine: Engine, prompts: list[list[int]], max_new_tokens: int, drafter: Drafter,
             sampling: SamplingParams = SamplingParams(greedy=True), *, seed: int = 0,
             stop_at_eos: bool = True) -> SpeculativeResult:
    """Up to `max_new_tokens` per prompt with drafts verified a step at a time (cache slot i = prompt i). Greedy:
    the same tokens as greedy `Engine.generate` (up to the order of floating-point sums between the verify step's
    attention and the decode step's); sampling (no penalties or logit bias): the target's distribution by the
    rejection rule (`accept_drafts`), drawn from a generator seeded `seed`. A sequence stops at its first EOS (kept)
    unless `stop_at_eos` is False. Logprobs: each token's under the model at temperature 1, as `Engine.generate`'s."""
    check_speculative(engine)
    engine.check_request(prompts, max_new_tokens)
    if sampling.penalized or sampling.logit_bias:
        raise RequestError("speculative decoding takes no penalties or logit bias")
    eos = set(engine.cfg.eos_token_id) if stop_at_eos else set()
    limit = engine.max_seq_len
    gen = torch.Generator(device=engine.device).manual_seed(seed)
    t0 = time.perf_counter()
    hidden = [] if drafter.reads_hidden else None
    logits = engine.prefill(prompts, hidden=hidden)
    tok, lp = sample(logits, sampling, gen)
    if hidden and max_new_tokens:  # the prompts' last hidden states, each position's next token
        at = [sum(map(len, prompts[:i])) for i in range(len(prompts))]
        nexts = [torch.cat((torch.tensor(p[1:], device=tok.device), tok[i:i + 1])) for i, p in enumerate(prompts)]
        drafter.observe([(i, 0, hidden[0][a:a + len(p)], nx) for i, (a, p, nx) in enumerate(zip(at, prompts, nexts))])
    out = [[int(t)] for t in tok.tolist()] if max_new_tokens else [[] for _ in prompts]
    lps = [[v] for v in lp.tolist()] if max_new_tokens else [[] for _ in prompts]
    t1 = time.perf_counter()
    live = [i for i in range(len(prompts)) if out[i] and out[i][-1] not in eos and max_new_tokens > 1]
    steps = drafted = accepted = 0
    while live:
        seqs = [prompts[i] + out[i] for i in live]
        feeds = []
        for i, seq, d in zip(live, seqs, drafter.draft_many(seqs, live)):
            room = min(max_new_tokens - len(out[i]) - 1, limit - len(seq))  # tokens past the correction's
            feeds.append([seq[-1]] + d[:max(room, 0)])
        firsts = [len(prompts[i]) + len(out[i]) - 1 for i in live]  # the position of each sequence's last token
        step, starts, logits, h = run_verify(engine, feeds, firsts, live, hidden=drafter.reads_hidden)
        bad = ~torch.isfinite(logits).all(-1)
        if bool(bad.any()):
            n = int(bad.nonzero()[0, 0])
            i = next(i for i, s, f in zip(live, starts, feeds) if s <= n < s + len(f))
            raise NonFiniteError(f"sequence {i}: the logits at position {int(step.positions[n])} hold NaN or inf")
        steps += 1
        still, kept, seen = [], {}, []
        for j, (i, f, s) in enumerate(zip(live, feeds, starts)):
            emit, got = accept(logits[s:s + len(f)], f, sampling, gen)
            kept[j] = len(emit)  # fed tokens whose state stays: the last token and the accepted drafts
            seen.append((i, firsts[j], s, emit))
            drafted += len(f) - 1
            accepted += len(emit) - 1
            for t, v in zip(emit, got):
                out[i].append(t)
                lps[i].append(v)
                if t in eos or len(out[i]) >= max_new_tokens:
                    break
            if out[i][-1] not in eos and len(out[i]) < max_new_tokens:
                still.append(i)
        rewind_states(step, kept)
        if drafter.reads_hidden and still:
            drafter.observe([(i, p, h[s:s + len(e)], torch.tensor(e, device=h.device)) for i, p, s, e in seen
                             if i in still])
        live = still
    t2 = time.perf_counter()
    return SpeculativeResult(out, lps, steps, drafted, accepted, t1 - t0, t2 - t1)
