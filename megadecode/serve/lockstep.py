"""Serving with expert parallelism: rank 0 serves (HTTP, scheduler, sampling, detokenization); every other rank
runs the same model steps in lockstep, told by rank 0 what each step is.

Rank 0's model runner publishes each step before it runs it (`Leader`, runner.ModelRunner's `mirror`): a prefill
(the prompts and their cache slots), a decode step (its padded size, kv_len and whether the scratch slot's state is
cleared; then the step's rows [tokens, positions, slots] as one broadcast over the experts' group, because with
overlapped steps the tokens exist only on rank 0's device), a slot clear, and the end. A follower (`follow`) replays
them on its engine and drops the logits. The messages go over the control group (gloo, host objects: group.py), so
an idle server sends nothing and a follower simply waits. Startup: every rank captures the same decode graphs
(runner.warmup: the same steps, collectives included) before rank 0 serves its first request.

If a step fails on rank 0 after it was published, the ranks are out of step: the server stops serving (the engine
loop ends, /health answers 503) and the followers fail at their next collective (the process group's timeout).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..runner import ModelRunner


class LockstepLost(BaseException):
    """A published step failed on rank 0: the ranks no longer run the same steps. A BaseException, so that the
    engine loop, which survives a failed step (`except Exception`), stops instead."""


class Leader:
    def __init__(self, ep):
        self.ep = ep

    def _send(self, *msg) -> None:
        dist.broadcast_object_list([msg], src=0, group=self.ep.control)

    def prefill(self, prompts: list[list[int]], slots: list[int]) -> None:
        self._send("prefill", [list(map(int, p)) for p in prompts], list(slots))

    def decode(self, rows: torch.Tensor, kv_len: int, clear_scratch: bool) -> torch.Tensor:
        """rows [3, P] (tokens, positions, slots) on the device -> the contiguous copy all ranks run."""
        self._send("decode", rows.shape[1], kv_len, clear_scratch)
        rows = rows.contiguous()
        dist.broadcast(rows, 0, group=self.ep.group)
        return rows

    def clear(self, slot: int) -> None:
        self._send("clear", slot)

    def stop(self) -> None:
        try:
            self._send("stop")
        except Exception:  # noqa: BLE001 - the others are gone already (stopped by the same signal, or failed)
            pass

    def lost(self, error: Exception) -> None:
        raise LockstepLost(f"a step published to the other ranks failed on rank 0 ({type(error).__name__}: {error}); "
                           f"the ranks are out of step, serving stops") from error


def follow(runner: ModelRunner, ep) -> int:
    """Replay rank 0's steps on this rank's engine until it says stop; the number of steps run."""
    engine, n = runner.engine, 0
    with torch.inference_mode():
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0, group=ep.control)
            kind, *args = box[0]
            if kind == "stop":
                return n
            if kind == "prefill":
                engine.prefill_into(*args)
            elif kind == "decode":
                P, kv_len, clear = args
                if clear:
                    engine.cache.clear_slot(runner.scratch, state_only=True)
                rows = torch.empty((3, P), dtype=torch.int64, device=engine.device)
                dist.broadcast(rows, 0, group=ep.group)
                engine.decode_into(rows[0], rows[1], rows[2], kv_len=kv_len)
            elif kind == "clear":
                engine.cache.clear_slot(args[0])
            else:
                raise RuntimeError(f"unknown lockstep message {kind!r} from rank 0")
            n += 1
