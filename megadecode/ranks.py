"""The command line's side of expert parallelism (`--ep N`, megadecode/parallel): how `generate`, `bench` and
`serve` run as N ranks.

    megadecode generate --ep 2 ...                               starts its 2 ranks on this machine
    torchrun --nproc-per-node 2 -m megadecode generate --ep 2 ...   the same ranks, started by torchrun; across
                                                                    nodes, the same command on each node with
                                                                    torchrun's --nnodes / --node-rank / --rdzv-*

Every rank parses the same arguments and runs the same command: rank 0 prints (generate, bench) or serves (serve),
the others compute their experts' share of every step and follow. Errors: the arguments and the config are
checked on every rank before the ranks connect, and only rank 0 reports them (they are the same everywhere);
loading is agreed (group.agree: a rank that cannot load its experts makes every rank stop, rank 0 naming it);
after that a rank's own error is printed with its rank, and the others stop at their next collective (at once
with gloo, at --dist-timeout with NCCL).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # parallel's modules import torch: imported where used, so that `add_args` (the parsers' flags)
    from .parallel import group  # does not wait for it
    from .parallel.combine import ExpertParallel

DEFAULT_TIMEOUT_S = 300.0
_joined = False


def add_args(p) -> None:
    p.add_argument("--ep", type=int, default=1, metavar="N",
                   help="expert parallelism over N ranks, one process per GPU (or CPU rank): the routed experts split "
                        "across ranks, the rest replicated. Outside torchrun the command starts the N ranks itself")
    p.add_argument("--dist-timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="S",
                   help="with --ep > 1: seconds a rank waits in a collective for the others before it fails")


def check(cfg, ep: int) -> None:
    """--ep against the model: a positive divisor of its routed experts (parallel/experts.py says why)."""
    from .parallel.experts import ExpertShard

    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise ValueError(f"--ep must be a positive integer, got {ep!r}")
    try:
        ExpertShard(cfg.num_experts, ep, 0)
    except ValueError as e:
        raise ValueError(f"--ep {ep}: {e}") from None


def must_spawn(ep: int) -> bool:
    """Whether this process starts the ranks itself: --ep > 1 outside torchrun."""
    from .parallel import group

    return ep > 1 and group.torchrun_env() is None


def spawn(argv: list[str], ep: int) -> int:
    from .parallel import launch

    return launch.spawn(argv, ep)


def join(args) -> group.EPGroup | None:
    """Connect this rank to the others (None for one rank); from here on errors are this rank's own."""
    from .parallel import group

    global _joined
    ep = group.init(args.ep, args.device, args.dist_timeout)
    _joined = ep is not None
    return ep


def device(args, ep: group.EPGroup | None) -> str:
    """Where this rank's weights live: the command's --device, on CUDA the rank's own GPU."""
    return str(ep.device) if ep is not None and ep.device.type == "cuda" else args.device


def expert_parallel(ep: group.EPGroup | None, cfg) -> ExpertParallel | None:
    from .parallel.combine import ExpertParallel
    from .parallel.experts import ExpertShard

    if ep is None:
        return None
    name = None
    if ep.device.type == "cuda":
        import torch

        name = torch.cuda.get_device_name(ep.device)
    return ExpertParallel(ExpertShard(cfg.num_experts, ep.world, ep.rank), ep.group, name)


def error_prefix() -> str | None:
    """How this rank reports an error: "" on rank 0; "rank r: " on another rank once the ranks are connected; None
    (say nothing) before that, or for an agreed failure, which rank 0 reports."""
    from .parallel import group

    r = group.rank()
    if r == 0:
        return ""
    return f"rank {r}: " if _joined else None


def leader() -> bool:
    from .parallel import group

    return group.rank() == 0


# What torch.distributed raises when a peer is gone or silent (gloo: a RuntimeError naming the closed connection;
# DistError subclasses for the store and network). NCCL's watchdog aborts the process itself at the timeout.
_PEER_SIGNS = ("Connection closed by peer", "Connection reset by peer", "Timed out waiting", "timed out")


def peer_failure(e: BaseException) -> str | None:
    """The one-line report of a collective that failed because another rank stopped or hung, or None (not that)."""
    import torch.distributed as dist

    from .parallel import group

    if not _joined or not isinstance(e, RuntimeError):
        return None
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if isinstance(e, getattr(dist, "DistError", ())) or any(sign in text for sign in _PEER_SIGNS):
        return (f"rank {group.rank()}: another rank stopped or stopped answering (its own error, if any, is printed "
                f"above or by torchrun): {text[:200]}")
    return None
