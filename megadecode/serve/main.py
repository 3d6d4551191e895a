"""`megadecode serve`: build the engine, capture its decode graphs (a progress bar), time the cold start, serve."""

from __future__ import annotations

import os
import socket
import sys

from .. import ranks
from ..config.registry import EXECUTOR_NAMES
from ..args import add_quiet, add_speculative, bar_off, byte_feed, int_list, seed_arg, speculative_flags_error
from ..presets import PRESETS

DEPS = ("fastapi", "uvicorn", "prometheus_client")
SWITCH_INTERVAL_S = 0.0005


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over the OpenAI HTTP API, with continuous batching",
                       description="An OpenAI-compatible server (/v1/completions, /v1/chat/completions, /v1/models, "
                                   "/health, /metrics, /tokenize, /detokenize, /version). Requests join and leave "
                                   "the running decode batch between "
                                   "steps; every decode graph is compiled and captured at startup. Needs the serve "
                                   "extra: pip install -e '.[serve]'.")
    p.add_argument("--model", default="tiny-qwen3-moe", help=f"preset ({', '.join(sorted(PRESETS))}), checkpoint "
                                                             "directory, or ORG/NAME in the local Hugging Face cache")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model name requests must give (default: --model)")
    p.add_argument("--executor", choices=["auto", *EXECUTOR_NAMES], default="auto",
                   help="how the decode step runs (README, Executors); auto: torch on the CPU, on a GPU the fastest "
                        "validated for the model at --max-batch from a measured table (named on startup)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the weights and cache live")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="weight and cache dtype")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port, printed)")
    p.add_argument("--max-batch", type=int, default=8, metavar="N",
                   help="sequences decoded at once (cache slots; the cache holds one more, for padding rows)")
    p.add_argument("--max-seq-len", type=int, default=None, metavar="N",
                   help="context per sequence, prompt + completion (default: the model's, at most 4096)")
    p.add_argument("--max-queue", type=int, default=256, metavar="N",
                   help="requests waiting for a slot; one more is answered 429")
    p.add_argument("--batch-sizes", type=int_list, default=None, metavar="LIST",
                   help="decode batch sizes captured at startup, a batch padded up to the next (default: powers of "
                        "two below --max-batch, and --max-batch)")
    p.add_argument("--max-prefill-tokens", type=int, default=None, metavar="N",
                   help="prompt tokens prefilled between two decode steps, at least one prompt (default: "
                        "--max-seq-len)")
    add_speculative(p)
    p.add_argument("--seed", type=seed_arg, default=0, help="seed of a preset's random weights, in [0, 2**32 - 1]")
    p.add_argument("--check-finite", action="store_true", help="reject checkpoint tensors with NaN/inf, naming them")
    p.add_argument("--ignore-unknown-tensors", action="store_true",
                   help="load a checkpoint that holds tensors the model does not use, with a warning naming them")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require Authorization: Bearer KEY on every route but /health (default: the "
                        "MEGADECODE_API_KEY environment variable; neither: no key)")
    p.add_argument("--log-level", choices=("critical", "error", "warning", "info", "debug"), default="warning",
                   help="uvicorn's log level (info logs every request)")
    add_quiet(p)
    ranks.add_args(p)
    p.set_defaults(func=cmd_serve)


def check_args(args) -> None:
    if args.api_key is None:
        args.api_key = os.environ.get("MEGADECODE_API_KEY") or None
    if args.api_key is not None and (not args.api_key or args.api_key != args.api_key.strip()):
        raise ValueError("--api-key must be a non-empty key without surrounding spaces")
    if args.max_batch < 1:
        raise ValueError(f"--max-batch must be >= 1, got {args.max_batch}")
    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_prefill_tokens is not None and args.max_prefill_tokens < 1:
        raise ValueError(f"--max-prefill-tokens must be >= 1, got {args.max_prefill_tokens}")
    if args.speculative and not 1 <= args.num_draft_tokens <= 7:
        raise ValueError(f"--num-draft-tokens must be in [1, 7], got {args.num_draft_tokens}")
    why = speculative_flags_error(args)
    if why is not None:
        raise ValueError(why)
    if args.speculative and args.ep > 1:
        raise ValueError("--speculative runs in one process: it cannot be used with --ep")
    if args.batch_sizes is not None and not all(1 <= b <= args.max_batch for b in args.batch_sizes):
        raise ValueError(f"--batch-sizes must be in [1, --max-batch = {args.max_batch}], got {args.batch_sizes}")
    missing = [d for d in DEPS if not _importable(d)]
    if missing:
        raise ModuleNotFoundError(f"`megadecode serve` needs {', '.join(missing)}: install the serve extra with "
                                  "pip install -e '.[serve]'", name=missing[0])


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (port 0: the kernel picks a free one), so the address is known before uvicorn runs."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on connections of such sockets. Without it each SSE
    # chunk after the headers waited for the client's delayed ACK (~40 ms on Linux: measured 43 ms to the first
    # token on the CPU, tokens then arriving in bursts)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(2048)
    return sock


def build_server(args, ep, progress=None):
    """The Server of this rank (every rank builds one: the same engine, runner and captured graphs). Under expert
    parallelism rank 0's runner publishes its steps (lockstep.Leader); the others replay them (`follow`).
    `progress(bytes, total bytes)`: the weights' build or load."""
    from ..engine import model_config
    from ..parallel.group import agree
    from .lockstep import Leader
    from .server import Server

    from ..backends.auto import resolve_executor

    leads = ep is not None and ep.rank == 0
    cfg = model_config(args.model)
    resolve_executor(args, cfg, args.max_batch, ep is None or ep.rank == 0)
    drafter = None
    if args.speculative in ("ngram", "draft"):  # mtp: the engine's own MTP layer, built with it (Server.build)
        from ..speculative import NgramDrafter, draft_model_drafter

        if args.speculative == "ngram":
            drafter = NgramDrafter(args.num_draft_tokens)
        else:
            from ..hub import resolve_model

            drafter = draft_model_drafter(resolve_model(args.draft_model), args.num_draft_tokens, cfg.vocab_size,
                                          device=ranks.device(args, ep), dtype=args.dtype, seed=args.seed,
                                          max_batch=args.max_batch, max_seq_len=args.max_seq_len)
    return agree(ep, Server.build, args.model, max_batch=args.max_batch, executor=args.executor,
                 device=ranks.device(args, ep), dtype=args.dtype, max_seq_len=args.max_seq_len, seed=args.seed,
                 check_finite=args.check_finite, ignore_unknown=args.ignore_unknown_tensors,
                 model_name=args.served_model_name or args.model, max_queue=args.max_queue,
                 batch_sizes=args.batch_sizes, max_prefill_tokens=args.max_prefill_tokens or args.max_seq_len,
                 parallel=ranks.expert_parallel(ep, cfg), mirror=Leader(ep) if leads else None,
                 progress=progress, drafter=drafter,
                 mtp_draft_tokens=args.num_draft_tokens if args.speculative == "mtp" else 0)


def follow(server, ep) -> int:
    """A rank other than 0: capture the same decode graphs as rank 0, then replay its steps until it stops; the
    number of steps replayed."""
    from .lockstep import follow as replay

    server.runner.warmup()
    return replay(server.runner, ep)


def cmd_serve(args, argv) -> int:
    import torch
    import uvicorn
    from tqdm import tqdm

    from ..engine import model_config
    from ..hub import resolve_model
    from .api import build_app

    check_args(args)
    args.served_model_name = args.served_model_name or args.model  # ORG/NAME stays the name requests give
    args.model = resolve_model(args.model)  # its snapshot in the local hub cache
    cfg = model_config(args.model)
    ranks.check(cfg, args.ep)
    if args.speculative == "mtp":
        from ..mtp import mtp_refusal

        why = mtp_refusal(cfg)
        if why:
            raise ValueError(f"--speculative mtp: {why}")
    if ranks.must_spawn(args.ep):
        return ranks.spawn(argv, args.ep)
    # Two threads share the GIL: the engine loop and the HTTP event loop. A thread waiting for it gets it only
    # after the switch interval (5 ms by default) when the holder does not block: tokens would reach clients in
    # bursts, and the engine would wait for the HTTP thread between steps. 0.5 ms keeps the hand-over short.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA GPU is available")
    sock = bind(args.host, args.port) if ranks.leader() else None  # before the slow part: a taken port fails at once
    ep = ranks.join(args)
    try:
        return _run(args, ep, sock, build_app, tqdm, uvicorn)
    finally:  # after the server is gone (_run returned): its engine's captured graphs would hold NCCL's teardown
        if ep is not None:
            ep.destroy()


def _run(args, ep, sock, build_app, tqdm, uvicorn) -> int:
    what = "build random weights" if args.model in PRESETS else "load weights"
    with tqdm(desc=what, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
              disable=bar_off(args, not ranks.leader())) as bar:
        server = build_server(args, ep, byte_feed(bar))
    if not ranks.leader():
        follow(server, ep)
        return 0
    return _serve(args, server, sock, build_app, tqdm, uvicorn)


def _serve(args, server, sock, build_app, tqdm, uvicorn) -> int:
    from ..engine import NonFiniteError

    name = args.served_model_name or args.model
    captures = bool(server.engine.executor.graph_lengths(1, 1, 1))  # eager executors have nothing to capture
    sizes = ",".join(map(str, server.runner.batch_sizes if server.runner.pad else range(1, server.max_batch + 1)))
    try:
        with tqdm(desc=f"compile + capture decode graphs (batch {sizes})", unit="graph", file=sys.stderr, total=0,
                  disable=bar_off(args, not captures)) as bar:
            server.start(bar)
    except BaseException as e:
        server.stop()  # with expert parallelism: tells the other ranks to stop too
        if isinstance(e, NonFiniteError):  # as generate says it
            hint = "" if args.model in PRESETS or args.check_finite else \
                " (--check-finite names a tensor that holds them)"
            raise NonFiniteError(f"{args.model}: {e}{hint}") from None
        raise
    host, port = sock.getsockname()[:2]
    cold = f"{server.cold_start_s:.1f} s" if server.cold_start_s is not None else "unknown"
    where = f", {args.ep} ranks" if args.ep > 1 else ""
    where += ", API key required" if args.api_key else ""
    print(f"megadecode: serving {name!r} ({args.executor}, {args.device}, {args.dtype}{where}) at "
          f"http://{host}:{port}/v1; "
          f"max batch {server.max_batch}, context {server.max_seq_len}; {server.graphs} decode graphs captured; "
          f"warm-up {server.warmup_s:.1f} s; cold start (process start to first token) {cold}", file=sys.stderr,
          flush=True)
    config = uvicorn.Config(build_app(server, api_key=args.api_key), log_level=args.log_level,
                            timeout_graceful_shutdown=5)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn shuts down gracefully on SIGINT / SIGTERM, then raises the signal again
        pass
    finally:
        server.stop()
    print("megadecode: server stopped", file=sys.stderr)
    return 0

