"""The `megadecode` command: generate text, write random checkpoints, benchmark decode steps.

    megadecode generate --model tiny-qwen3-moe --greedy
    megadecode make-checkpoint --preset tiny-deepseek-v3 --out /tmp/ckpt
    megadecode bench --preset qwen3-30b-a3b --batch 1,8,64 --executor torch,graph   (GPU only)
    megadecode validate --list; megadecode validate triton-router --quick
    megadecode tune --kernel fused-experts --shape k3 --batch 1,2,4,8,16   (GPU only)
    megadecode serve --model tiny-qwen3-moe --port 8000   (the serve extra: fastapi, uvicorn, prometheus-client)

Errors the user can fix (bad config, checkpoint, request or argument) print one line,
`megadecode: error: <message>`, and exit with code 2.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import math
import os
import signal
import sys
import threading
import warnings
from pathlib import Path

from . import ranks
from .args import add_quiet, add_speculative, bar_off, byte_feed, seed_arg, speculative_flags_error
from .config.registry import EXECUTOR_NAMES
from .presets import PRESETS
from .serve import main as serve_command

# Building the parsers imports no torch (`megadecode --help` answers at once): the commands' own modules, and what
# they need, are imported when a command runs; bench, validate and tune (whose modules import torch) are added only
# when named or when every parser is built (build_parser without argv).
# name -> (module with add_parser(sub, help) and the command, its one-line help)
HEAVY_COMMANDS = {
    "bench": ("megadecode.bench", "time decode steps per executor and batch on the GPU (MBU vs HBM floor)"),
    "validate": ("megadecode.validate.command", "validate an op variant against the torch reference"),
    "tune": ("megadecode.tune", "sweep a kernel's launch parameters on the GPU; store the best as JSON"),
}
COMMANDS = ("generate", "serve", "make-checkpoint", "bench", "validate", "tune")
DEFAULT_PROMPT = "Hello, megadecode!"


def user_errors() -> tuple[type[BaseException], ...]:
    """What a user can get wrong; anything else is a bug and keeps its traceback. Out of memory past the up-front
    check (memory.check_fits) is the user's to fix too (a smaller batch, context or dtype). A failure that the
    ranks of expert parallelism agreed on (RankFailed) is reported once, by rank 0. (Imported when an error is
    caught: by then the command ran, and torch is loaded.)"""
    import torch

    from .checkpoint import CheckpointError
    from .config import ConfigError
    from .engine import RequestError
    from .parallel.group import RankFailed

    return (ConfigError, CheckpointError, RequestError, FileNotFoundError, ValueError, torch.OutOfMemoryError,
            RankFailed)


def agree(*args, **kw):
    """parallel.group.agree, imported on use (a test replaces this name)."""
    from .parallel.group import agree as run

    return run(*args, **kw)


class Parser(argparse.ArgumentParser):
    """argparse's errors as the command's other errors: one `megadecode: error:` line, exit code 2."""

    def error(self, message: str):
        self.exit(2, f"megadecode: error: {message} (see `{self.prog} --help`)\n")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's help ends with its default, unless the help already says it (`default:`) or the flag is
    required; switches are off unless given."""

    def _get_help_string(self, action) -> str:
        text = action.help or ""
        if action.required:
            return f"{text} (required)"
        if not action.option_strings or "default" in text or action.default is argparse.SUPPRESS:
            return text
        if action.default is False:
            return f"{text} (default: off)"
        return f"{text} (default: %(default)s)"


def token_id_list(text: str) -> list[int]:
    """`--token-ids 256,1,2` -> [256, 1, 2]."""
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("expected at least one token id")
    return ids


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate tokens from a preset (random weights) or a checkpoint",
                       description="Generate tokens with a preset (random weights) or an HF checkpoint directory. "
                                   "The first new token comes from the prompt's logits (prefill), each further "
                                   "one from a decode step: --max-new-tokens N runs N - 1 decode steps.")
    p.add_argument("--model", default="tiny-qwen3-moe",
                   help=f"preset ({', '.join(sorted(PRESETS))}), checkpoint directory, or ORG/NAME in the local "
                        "Hugging Face cache")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", action="append", metavar="TEXT",
                     help=f"prompt text; repeat for a batch (default: {DEFAULT_PROMPT!r})")
    src.add_argument("--token-ids", action="append", type=token_id_list, metavar="IDS",
                     help="prompt as comma-separated token ids, instead of --prompt; repeat for a batch "
                          "(default: --prompt's)")
    p.add_argument("--max-new-tokens", type=int, default=32, metavar="N",
                   help="tokens to generate per prompt (sequences stop early at EOS)")
    p.add_argument("--min-tokens", type=int, default=0, metavar="N",
                   help="no EOS among a sequence's first N new tokens (vLLM's min_tokens), at most --max-new-tokens")
    p.add_argument("--ignore-eos", action="store_true",
                   help="keep the tokens after an EOS: every sequence gets --max-new-tokens")
    add_speculative(p)
    guide = p.add_mutually_exclusive_group()
    guide.add_argument("--guided-json", metavar="SCHEMA",
                       help="structured output: every sequence is JSON valid against this JSON schema (its JSON "
                            "text, or a file holding it); needs xgrammar (pip install -e '.[serve]')")
    guide.add_argument("--guided-regex", metavar="REGEX", help="structured output: every sequence matches REGEX")
    guide.add_argument("--guided-choice", action="append", metavar="TEXT",
                       help="structured output: every sequence is one of these strings (repeat for each)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the weights and cache live")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="weight and cache dtype")
    p.add_argument("--executor", choices=["auto", *EXECUTOR_NAMES], default="auto",
                   help="how the decode step runs (README, Executors); auto: torch on the CPU, on a GPU the fastest "
                        "validated for the model at this batch from a measured table (named in one line); fused "
                        "needs Triton (on the CPU only under TRITON_INTERPRET=1)")
    p.add_argument("--greedy", action="store_true",
                   help="argmax decoding (ignores --temperature, --top-p, --top-k, --min-p; not the penalties)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature, >= 0 (0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1]")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most probable tokens (0: all)")
    p.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens less probable than min-p x the most probable one, in [0, 1]")
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtracted from a token's logit once it is in the output, in [-2, 2]")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtracted from a token's logit per occurrence in the output, in [-2, 2]")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="a prompt or output token's logit divided by it when positive, multiplied when not (> 0)")
    p.add_argument("--seed", type=seed_arg, default=0,
                   help="seed of the preset's random weights and of sampling, in [0, 2**32 - 1]")
    p.add_argument("--check-finite", action="store_true", help="reject checkpoint tensors with NaN/inf, naming them")
    p.add_argument("--ignore-unknown-tensors", action="store_true",
                   help="load a checkpoint that holds tensors the model does not use, with a warning naming them "
                        "(without it, an error)")
    p.add_argument("--json", action="store_true", help="print one JSON object to stdout and nothing else")
    add_quiet(p)
    ranks.add_args(p)
    p.set_defaults(func=cmd_generate)


def _add_make_checkpoint(sub) -> None:
    p = sub.add_parser("make-checkpoint", help="write a random-weight HF-format checkpoint of a preset",
                       description="Write a random-weight HF-format checkpoint (config.json + safetensors).")
    p.add_argument("--preset", required=True, help=f"one of {', '.join(sorted(PRESETS))}")
    p.add_argument("--out", required=True, metavar="DIR", help="a new or empty directory")
    p.add_argument("--overwrite", action="store_true",
                   help="write into a non-empty DIR, replacing its config.json and safetensors files")
    p.add_argument("--seed", type=seed_arg, default=0, help="seed of the random weights, in [0, 2**32 - 1]")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="dtype of the stored weights")
    p.set_defaults(func=cmd_make_checkpoint)


def _command(argv: list[str]) -> str | None:
    """The command argv names (its first word that is not an option), or None."""
    return next((a for a in argv if not a.startswith("-")), None)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The command line's parser. With `argv`, bench, validate and tune get their flags (and their modules are
    imported) only when argv names them; the others are listed with their help line alone. Without, every parser."""
    import importlib

    parser = Parser(prog="megadecode", description="Decode engine for extremely sparse Mixture-of-Experts models.",
                    formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")
    chosen = None if argv is None else _command(argv)
    for name in COMMANDS:
        if name == "generate":
            _add_generate(sub)
        elif name == "serve":
            serve_command.add_parser(sub)
        elif name == "make-checkpoint":
            _add_make_checkpoint(sub)
        else:
            module, help_ = HEAVY_COMMANDS[name]
            if argv is None or chosen == name:
                importlib.import_module(module).add_parser(sub, help_)
            else:
                sub.add_parser(name, help=help_)
    for p in sub.choices.values():  # add_parser takes no formatter from its parent
        p.formatter_class = HelpFormatter
    return parser


def _sampling(args):
    """SamplingParams from the flags, with errors that name the flags."""
    from .engine import RequestError
    from .sampling import GREEDY_BELOW, SamplingParams

    if not args.greedy and not (args.temperature >= 0 and math.isfinite(args.temperature)):
        raise RequestError(f"--temperature must be finite and >= 0 (0: argmax, as --greedy), got {args.temperature}")
    if 0 <= args.temperature < GREEDY_BELOW:  # the server's rule: 0 (or nearly) is greedy
        args.greedy = True
    if not 0 < args.top_p <= 1:
        raise RequestError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.top_k < 0:
        raise RequestError(f"--top-k must be >= 0 (0: every token), got {args.top_k}")
    if not 0 <= args.min_p <= 1:
        raise RequestError(f"--min-p must be in [0, 1], got {args.min_p}")
    for flag in ("presence_penalty", "frequency_penalty"):
        v = getattr(args, flag)
        if not -2 <= v <= 2:
            raise RequestError(f"--{flag.replace('_', '-')} must be in [-2, 2], got {v}")
    if not (args.repetition_penalty > 0 and math.isfinite(args.repetition_penalty)):
        raise RequestError(f"--repetition-penalty must be finite and > 0 (1: none), got {args.repetition_penalty}")
    return SamplingParams(greedy=args.greedy, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          min_p=args.min_p, presence_penalty=args.presence_penalty,
                          frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty)


def cmd_generate(args, argv) -> int:
    import torch
    from tqdm import tqdm

    from .backends.auto import resolve_executor
    from .backends.fused.kernels import require_triton
    from .engine import NonFiniteError, RequestError, model_config
    from .hub import resolve_model
    from .tokenizer import load_tokenizer

    name, args.model = args.model, resolve_model(args.model)  # ORG/NAME: its snapshot in the local hub cache
    if args.draft_model is not None:
        args.draft_model = resolve_model(args.draft_model)

    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA GPU is available")
    if args.max_new_tokens < 0:
        raise RequestError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if not 0 <= args.min_tokens <= args.max_new_tokens:
        raise RequestError(f"--min-tokens must be in [0, --max-new-tokens = {args.max_new_tokens}], got "
                           f"{args.min_tokens}")
    sampling = _sampling(args)
    cfg = model_config(args.model)
    if args.speculative or args.draft_model is not None:
        _check_speculative(args, sampling, cfg)
    tok = load_tokenizer(None if args.model in PRESETS else args.model)
    guide = _guide(args, cfg, tok)  # compiled before any weight is built: a bad schema fails at once
    if args.token_ids:
        prompts = args.token_ids
    else:
        prompts = [tok.encode(t) for t in (args.prompt or [DEFAULT_PROMPT])]
    i = max(range(len(prompts)), key=lambda j: len(prompts[j]))
    need = len(prompts[i]) + args.max_new_tokens
    if need > cfg.max_position_embeddings:
        raise RequestError(f"prompt {i} has {len(prompts[i])} tokens; with --max-new-tokens {args.max_new_tokens} it "
                           f"needs {need} positions, more than the model's context of {cfg.max_position_embeddings} "
                           f"(max_position_embeddings)")
    ranks.check(cfg, args.ep)
    if ranks.must_spawn(args.ep):
        return ranks.spawn(argv, args.ep)
    ep = ranks.join(args)
    resolve_executor(args, cfg, len(prompts), ranks.leader() and not args.json)
    if args.executor == "fused":
        require_triton("--executor fused")
    try:
        res = _generate(args, cfg, ep, prompts, need, sampling, tqdm, guide)
    finally:  # after the engine is gone (_generate returned): its captured graphs would hold NCCL's teardown
        if ep is not None:
            ep.destroy()
    if not ranks.leader():
        return 0
    texts = [tok.decode(ids) for ids in res.token_ids]
    spec = None
    if args.speculative:
        spec = {"drafter": args.speculative, "draft_model": args.draft_model,
                "num_draft_tokens": args.num_draft_tokens, "steps": res.steps,
                "drafted": res.drafted, "accepted": res.accepted, "acceptance": res.acceptance,
                "tokens_per_step": res.tokens_per_step}
    if args.json:
        doc = {"model": name, "executor": args.executor, "device": args.device, "dtype": args.dtype,
               "ep": args.ep, "token_ids": res.token_ids, "logprobs": res.logprobs, "text": texts,
               "warmup_s": getattr(res, "warmup_s", 0.0), "prefill_s": res.prefill_s, "decode_s": res.decode_s,
               "decode_tokens_per_s": res.decode_tokens_per_s}
        if spec is not None:
            doc["speculative"] = spec
        try:
            text = json.dumps(doc, allow_nan=False)  # strict JSON: never a bare NaN or Infinity
        except ValueError:
            raise NonFiniteError(f"{args.model}: the result holds NaN or inf values, which JSON cannot carry") from None
        print(text)
        return 0
    for i, (prompt, text) in enumerate(zip(prompts, texts)):
        print(f"[{i}] {tok.decode(prompt)!r} -> {text!r}")
    if spec is not None:
        print(f"prefill {res.prefill_s * 1e3:.1f} ms, {res.steps} verify steps x {len(prompts)} sequences in "
              f"{res.decode_s * 1e3:.1f} ms: {res.decode_tokens_per_s:.1f} tokens/s; {res.accepted} of "
              f"{res.drafted} draft tokens accepted ({res.acceptance:.0%}), {res.tokens_per_step:.2f} tokens a "
              f"sequence a step ({args.executor}, {args.device}, {args.dtype})")
        return 0
    if res.warmup_steps:
        print(f"warm-up {res.warmup_s * 1e3:.1f} ms: compiled and captured {res.warmup_steps} decode graphs before "
              "the timed steps")
    where = f", {args.ep} ranks" if args.ep > 1 else ""
    print(f"prefill {res.prefill_s * 1e3:.1f} ms, decode {res.decode_steps} steps x {len(prompts)} sequences "
          f"in {res.decode_s * 1e3:.1f} ms: {res.decode_tokens_per_s:.1f} tokens/s "
          f"({args.executor}, {args.device}, {args.dtype}{where})")
    return 0


def _check_speculative(args, sampling, cfg) -> None:
    """--speculative's limits, named by flag: no penalties, one process, no structured output or min-tokens beside
    it."""
    from .engine import RequestError, model_config
    from .speculative import MAX_DRAFT

    why = speculative_flags_error(args)
    if why is not None:
        raise RequestError(why)
    if args.draft_model is not None:
        from .speculative import check_draft_model

        check_draft_model(model_config(args.draft_model), cfg.vocab_size)
    if args.speculative == "mtp":
        from .mtp import mtp_refusal

        why = mtp_refusal(cfg)
        if why:
            raise RequestError(f"--speculative mtp: {why}")
    if not 1 <= args.num_draft_tokens <= MAX_DRAFT:
        raise RequestError(f"--num-draft-tokens must be in [1, {MAX_DRAFT}], got {args.num_draft_tokens}")
    if sampling.penalized:
        raise RequestError("--speculative does not take the penalties")
    for flag, on in (("--min-tokens", args.min_tokens), ("--ep", args.ep > 1),
                     ("--guided-json / --guided-regex / --guided-choice",
                      args.guided_json or args.guided_regex or args.guided_choice)):
        if on:
            raise RequestError(f"--speculative cannot be used with {flag}")


def _guide(args, cfg, tok):
    """generate's structured output flags as (Grammars, compiled grammar), or None; errors name the flag."""
    from .engine import RequestError
    from .structured import Grammars, GuideSpec

    if args.guided_json is not None:
        flag = "--guided-json"
        try:
            schema = json.loads(args.guided_json)
        except ValueError:  # not JSON text: a file holding it
            try:
                text = Path(args.guided_json).read_text()
            except OSError as e:
                raise RequestError(f"--guided-json {args.guided_json!r}: neither JSON nor a readable file "
                                   f"({e.strerror})") from None
            try:
                schema = json.loads(text)
            except ValueError as e:
                raise RequestError(f"--guided-json: {args.guided_json} is not valid JSON ({e})") from None
        if not isinstance(schema, dict):
            raise RequestError("--guided-json: a JSON schema is an object")
        spec = GuideSpec("json_schema", json.dumps(schema))
    elif args.guided_regex is not None:
        spec, flag = GuideSpec("regex", args.guided_regex), "--guided-regex"
    elif args.guided_choice is not None:
        if not all(args.guided_choice):
            raise RequestError("--guided-choice: the strings must not be empty")
        spec, flag = GuideSpec("choice", json.dumps(args.guided_choice)), "--guided-choice"
    else:
        return None
    if args.ignore_eos:
        raise RequestError(f"{flag} ends each sequence at its grammar's EOS: it cannot be used with --ignore-eos")
    try:
        grammars = Grammars(tok, cfg.vocab_size, tuple(cfg.eos_token_id))
        return grammars, grammars.compile(spec)
    except ValueError as e:
        raise RequestError(f"{flag}: {e}") from None


def _generate(args, cfg, ep, prompts, need, sampling, tqdm, guide=None):
    """Load the engine and generate; the engine (and its CUDA graphs) is freed when this returns."""
    from .engine import Engine, NonFiniteError

    off = bar_off(args, args.json, not ranks.leader())
    what = "build random weights" if args.model in PRESETS else "load weights"
    with tqdm(desc=what, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr, disable=off) as bar:
        engine = agree(ep, Engine.from_pretrained, args.model, device=ranks.device(args, ep), dtype=args.dtype,
                       executor=args.executor, seed=args.seed, check_finite=args.check_finite,
                       max_batch=len(prompts), ignore_unknown=args.ignore_unknown_tensors, max_seq_len=need,
                       parallel=ranks.expert_parallel(ep, cfg), progress=byte_feed(bar),
                       mtp=args.speculative == "mtp")
    engine.check_request(prompts, args.max_new_tokens)  # before the progress bars show up
    bars = (tqdm(desc="compile and capture", unit="graph", file=sys.stderr, disable=off),
            tqdm(total=sum(map(len, prompts)), desc="prefill", unit="token", file=sys.stderr, disable=off),
            tqdm(total=max(args.max_new_tokens - 1, 0), desc="decode", unit="step", file=sys.stderr, disable=off))
    try:
        with bars[0] as warm, bars[1] as pre, bars[2] as progress:
            if args.speculative:
                from .speculative import MtpDrafter, NgramDrafter, check_speculative, draft_model_drafter, generate

                check_speculative(engine)
                if args.speculative == "ngram":
                    drafter = NgramDrafter(args.num_draft_tokens)
                elif args.speculative == "mtp":
                    drafter = MtpDrafter(engine, args.num_draft_tokens)
                else:
                    drafter = draft_model_drafter(args.draft_model, args.num_draft_tokens, cfg.vocab_size,
                                                  device=engine.device, dtype=args.dtype, seed=args.seed,
                                                  max_batch=len(prompts), max_seq_len=need)
                return generate(engine, prompts, args.max_new_tokens, drafter, sampling, seed=args.seed,
                                stop_at_eos=not args.ignore_eos)
            guides = None if guide is None else [guide[0].guide(guide[1]) for _ in prompts]
            return engine.generate(prompts, args.max_new_tokens, sampling, seed=args.seed, progress=progress,
                                   warmup_progress=warm, prefill_progress=pre, stop_at_eos=not args.ignore_eos,
                                   min_tokens=args.min_tokens, guides=guides)
    except NonFiniteError as e:
        hint = "" if args.model in PRESETS or args.check_finite else \
            " (--check-finite names a tensor that holds them)"
        raise NonFiniteError(f"{args.model}: {e}{hint}") from None


def cmd_make_checkpoint(args, argv) -> int:
    from .checkpoint import make_checkpoint
    from .engine import resolve_dtype

    out = make_checkpoint(args.out, args.preset, seed=args.seed, dtype=resolve_dtype(args.dtype),
                          overwrite=args.overwrite)
    print(f"wrote {args.preset} checkpoint ({args.dtype}, seed {args.seed}) to {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    code = _main(argv)
    group = sys.modules.get("megadecode.parallel.group")  # loaded when a command ran with expert parallelism
    # expert parallelism: NCCL's teardown hung (EPGroup.destroy); the interpreter's exit would wait for it again
    if group is not None and group.stuck_teardown():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code if isinstance(code, int) else 1)
    return code


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if hasattr(signal, "SIGUSR1") and threading.current_thread() is threading.main_thread():
        # `kill -USR1 <pid>` prints every thread's Python stack to stderr and the command goes on: where a run that
        # seems hung is waiting (bench/ep_tokens.py sends it to a run past its limit before stopping it)
        try:
            faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
        except (OSError, ValueError):  # stderr is not a file (captured, as under pytest): no stacks to print
            pass
    try:
        args = build_parser(argv).parse_args(argv)
    except SystemExit as e:  # --help, or a bad argument (Parser.error printed it): the code, not an exception
        return e.code
    try:
        with warnings.catch_warnings():  # warnings (e.g. unknown checkpoint tensors) as one line each
            warnings.showwarning = _show_warning
            return args.func(args, argv)
    except Exception as e:
        code = _report(e, args)
        if code is None:  # a bug: its traceback
            raise
        return code


def _report(e: Exception, args) -> int | None:
    """A command's failure as one line and its exit code, or None when it is not one the user can fix."""
    if isinstance(e, user_errors()):
        from .parallel.group import RankFailed

        prefix = ranks.error_prefix()  # expert parallelism: who reports (ranks.py)
        if prefix is not None and not (isinstance(e, RankFailed) and prefix):
            print(f"megadecode: error: {prefix}{e}", file=sys.stderr)
        return 2
    if isinstance(e, RuntimeError):  # expert parallelism: a collective failed because another rank is gone
        lost = ranks.peer_failure(e)
        if lost is None:
            return None
        print(f"megadecode: error: {lost}", file=sys.stderr)
        return 1
    if isinstance(e, ModuleNotFoundError):  # an optional dependency this command needs
        if (e.name or "").split(".")[0] in serve_command.DEPS:  # `megadecode serve` without the serve extra
            print(f"megadecode: error: {e}", file=sys.stderr)
            return 2
        if (e.name or "").split(".")[0] != "triton":
            return None
        print(f"megadecode: error: {e}" if "install" in str(e) else
              f"megadecode: error: `megadecode {args.command}` needs Triton, which cannot be imported here ({e}); "
              f"install it with `pip install triton==3.6.0`", file=sys.stderr)
        return 2
    return None


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"megadecode: warning: {message}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
