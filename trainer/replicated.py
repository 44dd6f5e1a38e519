"""One adapter across data-parallel replicas (server/replicas.py starts them): every
replica trains on its own recordings, and a sync thread combines what they computed over
torch.distributed, so that every replica applies the same optimizer steps and rollbacks
in the same order — version v is the same weights on every replica, bit for bit.

A round, on each replica's sync thread (never on the device thread: serving never waits
in a collective, only this thread does):
  1. it waits up to `round_interval_s` for this replica's contribution — a finished
     job's summed gradients, flattened, with its entry count and whether its loss was
     finite — or for a rollback rank 0 was asked for;
  2. gathers a small control vector: entries, non-finite jobs, the rollback's saved
     version (rank 0's), stop, whether rank 0 has a gate verdict to send, and the version
     through which the replica's ledger fates are committed — the smallest is what rank 0
     may save (trainer/replica_fates.py) — and whether it is leaving the group;
  3. with entries anywhere, all-reduces the gradients (zeros from a replica that had
     none); with a rollback, broadcasts rank 0's snapshot of the saved version; with a
     verdict, broadcasts it;
  4. queues the result, which the device thread applies in order between jobs
     (`OnlineTraining.run_slice`): the same AdamW step, its learning rate scaled by the
     step's entries on all replicas, on the same summed gradients; or the same rollback.

With an eval gate every replica holds each new version as a candidate, serving the
promoted one; rank 0 alone scores it, and its verdict, broadcast at a round, is carried
out by every replica (each quarantines the labels it trained into a rejected version).

A replica whose job waits for its round starts no other job. A job's gradient is ∇L at
the weights it ran under; when steps from other replicas landed while it ran, it is
applied a version later than that — a delayed gradient, as the weight stash's are. But a
job that ran on weights a rollback replaced is left out of the sum (`LeftOut`: its
entries train again), as one server abandons the job a rollback interrupts: each replica
knows it alone, from the rollbacks its rounds made and those it had applied.

What the rounds carry is in trainer/replica_messages.py.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import datetime
import hashlib
import logging
import queue
import re
import threading
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from trainer.adapter_store import AdapterSnapshot
from trainer.replica_fates import FateWatermarks
from trainer.replica_messages import (CombinedStep, Contribution, LeftOut, ReplicatedRollback, ReplicatedVerdict,
                                      RollbackSuperseded)

logger = logging.getLogger(__name__)

# how long a sync thread waits for its replica's contribution before a round without one
ROUND_INTERVAL_S = 0.05
# a round that waits longer than this for a replica fails (the replica is dead)
ROUND_TIMEOUT_S = 60
# how long a shutdown's last word waits for every replica: they reach it after uvicorn's drain (10 s at
# most), and the elastic agent kills them 30 s after its SIGTERM
LAST_WORD_TIMEOUT_S = 20
# a completion id names the replica that served it: chatcmpl-r1-<hex>
_REPLICA_TAG = re.compile(r"^[a-z]+[-_]r(\d+)-")


@dataclass(frozen=True)
class Replica:
    """This process's place among the data-parallel replicas (torch.distributed's rank)."""

    rank: int
    world_size: int
    # the rank among this node's replicas (its device: cuda:local_rank) and their number
    local_rank: int = 0
    local_world_size: int = 1

    def tag(self, prefix: str) -> str:
        """The start of the ids of completions this replica serves (`prefix` ends with its
        separator: "chatcmpl-", "resp_")."""
        return f"{prefix}r{self.rank}-"

    def owner_of(self, completion_id: str) -> int:
        """The rank whose recording a completion's label trains on (ids without a tag were
        served by a single replica: rank 0's; ranks beyond a smaller group wrap around)."""
        match = _REPLICA_TAG.match(completion_id)
        return int(match.group(1)) % self.world_size if match else 0

    def owns(self, completion_id: str) -> bool:
        return self.owner_of(completion_id) == self.rank


def weights_digest(params: list[torch.Tensor]) -> str:
    """A hash of the weights' bytes, in order: equal digests, equal weights bit for bit."""
    h = hashlib.sha256()
    for p in params:
        h.update(p.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


class ReplicaSync:
    def __init__(self, params: list[torch.nn.Parameter], rank: int, wakeup: Callable[[], None] = lambda: None,
                 round_interval_s: float = ROUND_INTERVAL_S, round_timeout_s: float = ROUND_TIMEOUT_S,
                 last_word_timeout_s: float = LAST_WORD_TIMEOUT_S):
        """`params`: the adapter's trainable parameters, in the same order on every
        replica; `wakeup`: wakes the serving loop when a result is queued; a round that
        waits `round_timeout_s` for a replica fails, and this replica leaves the group."""
        self.params = params
        self.rank = rank
        self.wakeup = wakeup
        self.round_interval_s = round_interval_s
        # why the sync stopped (a replica died, or the group is shutting down)
        self.stopped: str | None = None
        self._numel = sum(p.numel() for p in params)
        self._device = params[0].device
        self._inbox: queue.Queue[Contribution] = queue.Queue()
        self._results: collections.deque = collections.deque()
        self._rollback: ReplicatedRollback | None = None
        self._verdict: ReplicatedVerdict | None = None
        # rollbacks the device thread applied, and the rounds made (a contribution of a job run
        # before one of them is `LeftOut`)
        self.rollbacks_applied = 0
        self._rollbacks_made = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # this replica's ledger fates, and every replica's, as the rounds hear them
        self.fates = FateWatermarks(-1)
        self._thread = threading.Thread(target=self._run, name="alchemist-replica-sync", daemon=True)
        # groups of the rounds' own (collectives of one group must come in the same order on
        # every replica, which the sync thread alone guarantees for its groups): the control
        # vector and the broadcast objects on the host (gloo), so that a round waits on no
        # device stream; the gradients on the device's backend (NCCL on GPUs), on a stream
        # of their own
        timeout = datetime.timedelta(seconds=round_timeout_s)
        self._control = dist.new_group(backend="gloo", timeout=timeout)
        self._group = dist.new_group(timeout=timeout)
        # a shutdown's last word (`last_word`), after the rounds
        self._last_word = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=last_word_timeout_s))
        self._stream = torch.cuda.Stream(self._device) if self._device.type == "cuda" else None

    # -- at start, before serving --------------------------------------------------------

    def adopt_rank0(self, snapshot: Callable[[], AdapterSnapshot], restore) -> AdapterSnapshot:
        """Every replica takes rank 0's adapter (resumed or freshly initialised): its
        weights, optimizer state and version. `snapshot()` is called on rank 0;
        `restore(snapshot)` on the others. Returns the adopted snapshot."""
        box = [snapshot() if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self._control)
        if self.rank != 0:
            restore(box[0])
        return box[0]

    def largest(self, value: int) -> int:
        """The largest of every replica's `value` (at start, before serving)."""
        box = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(box, op=dist.ReduceOp.MAX, group=self._control)
        return int(box.item())

    def start(self, version: int) -> None:
        """Starts the rounds from `version`, the adopted adapter's on every replica."""
        self.fates.written(version)
        self.fates.heard(version)
        self._thread.start()

    # -- the device thread ---------------------------------------------------------------

    def contribute(self, entries: int, finite: bool) -> None:
        """Hands this replica's accumulated gradients to the next round (device thread);
        the parameters' gradients are cleared."""
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).float()
                          for p in self.params])
        for p in self.params:
            p.grad = None
        ready = None
        if self._stream is not None:
            ready = torch.cuda.Event()
            ready.record()
        self._inbox.put(Contribution(flat, entries, finite, ready, self.rollbacks_applied))

    def has_result(self) -> bool:
        with self._lock:
            return bool(self._results)

    def has_verdict(self) -> bool:
        with self._lock:
            return any(isinstance(item, ReplicatedVerdict) for item in self._results)

    def next_result(self) -> CombinedStep | ReplicatedRollback | ReplicatedVerdict | LeftOut | None:
        with self._lock:
            return self._results.popleft() if self._results else None

    def load_gradients(self, step: CombinedStep) -> None:
        """Makes `step`'s summed gradients the parameters' (device thread)."""
        if step.done is not None:
            torch.cuda.current_stream().wait_event(step.done)
            # a buffer of zeros was allocated on the rounds' stream: without this, the allocator
            # could hand its block to that stream again while the optimizer still reads it here
            step.grads.record_stream(torch.cuda.current_stream())
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad = step.grads[offset:offset + n].view_as(p).to(p.dtype)
            offset += n

    # -- rank 0's rollback ---------------------------------------------------------------

    def request_rollback(self, snapshot: AdapterSnapshot) -> concurrent.futures.Future:
        """Rank 0: every replica loads `snapshot` at the next round; the future gives the
        new version once this replica applied it."""
        if self.rank != 0:
            raise RuntimeError("a rollback is requested on rank 0")
        done: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self.stopped is not None:
                done.set_exception(RuntimeError(f"the replicas' sync stopped: {self.stopped}"))
                return done
            if self._rollback is not None:
                self._rollback.done.set_exception(RollbackSuperseded(
                    f"a later rollback, to version {snapshot.version}, asked before this one reached every replica, "
                    "superseded it: that one is applied"))
            self._rollback = ReplicatedRollback(snapshot, done)
        return done

    def publish_verdict(self, verdict: ReplicatedVerdict) -> None:
        """Rank 0: the eval gate's verdict goes to every replica at the next round."""
        with self._lock:
            self._verdict = verdict

    def take_verdict(self) -> ReplicatedVerdict | None:
        """The first verdict among the queued results, taken out ahead of the steps queued
        before it (device thread): while a candidate waits for its verdict no step
        applies, on any replica, so every replica takes it at the same point."""
        with self._lock:
            for index, item in enumerate(self._results):
                if isinstance(item, ReplicatedVerdict):
                    del self._results[index]
                    return item
        return None

    def leave(self, reason: str = "this replica left the group") -> None:
        """This replica cannot follow the sequence any more (a result it could not apply, a
        round that failed): it stops its process with SIGTERM, which uvicorn raises again
        once it has shut down, so that the process ends by the signal: a failure, on which
        the elastic agent restarts the group."""
        import os
        import signal

        with self._lock:
            self.stopped = reason
        self.fates.settle(failed=True)
        os.kill(os.getpid(), signal.SIGTERM)

    def last_word(self) -> None:
        """At a shutdown the replicas agreed on, on each replica once it applied the last rounds'
        results and its ledger committed their fates (each in its own time: they drain their
        requests apart): every replica's watermark once more, for rank 0's final save. A
        replica that does not answer within `last_word_timeout_s` (not shutting down, or
        stuck) leaves what it did not confirm unsaved."""
        if self.fates.final or self._thread.ident is None:  # failed; or the rounds never started
            return
        gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(self._last_word))]
        try:
            dist.all_gather(gathered, torch.tensor([self.fates.mine]), group=self._last_word)
        except Exception as exc:  # noqa: BLE001 - a replica gone or not shutting down
            logger.warning("replica %d: no last word from every replica (%s): versions they did not confirm are "
                           "not saved", self.rank, exc)
            self.fates.settle(failed=True)
            return
        self.fates.heard(min(int(t) for t in gathered))
        self.fates.settle()

    # -- the sync thread -----------------------------------------------------------------

    def close(self, timeout_s: float = 10.0) -> None:
        """Leaves the rounds: the others leave at the same round."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)
        while True:
            try:
                contribution = self._inbox.get(timeout=self.round_interval_s)
            except queue.Empty:
                contribution = None
            with self._lock:
                rollback, self._rollback = self._rollback, None
                verdict, self._verdict = self._verdict, None
            try:
                stop = self._round(contribution, rollback, verdict)
            except Exception as exc:  # noqa: BLE001 - a replica died or hangs: its collective failed or timed out
                self._fail(f"a collective failed: {exc}", rollback, logging.ERROR)
                if not self._stop.is_set():  # serving on without training would hold labels forever
                    self.leave(f"a collective failed: {exc}")
                return
            if stop:
                self._fail("the replicas are shutting down", None, logging.INFO)
                return

    def _round(self, contribution: Contribution | None, rollback: ReplicatedRollback | None,
               verdict: ReplicatedVerdict | None = None) -> bool:
        results: list = []
        if contribution is not None and contribution.rollbacks < self._rollbacks_made:
            results.append(LeftOut(contribution.entries))  # the weights it ran on were rolled back
            contribution = None
        control = torch.tensor([contribution.entries if contribution else 0,
                                0 if contribution is None or contribution.finite else 1,
                                rollback.snapshot.version + 1 if rollback else 0,
                                1 if self._stop.is_set() else 0,
                                1 if verdict is not None else 0, self.fates.mine,
                                1 if self.fates.failed else 0], dtype=torch.float64)  # gloo: on the host
        gathered = [torch.empty_like(control) for _ in range(dist.get_world_size(self._control))]
        dist.all_gather(gathered, control, group=self._control)
        table = torch.stack(gathered)
        entries, non_finite, rollback_to, stop, verdicts = (int(v) for v in table[:, :5].sum(0).tolist())
        self.fates.heard(int(table[:, 5].min()))
        if table[:, 6].any():  # a replica leaves the group: its stop is a failure, not a shutdown agreed on
            self.fates.settle(failed=True)
        if entries:
            results.append(self._sum_gradients(contribution, entries, non_finite == 0))
        if rollback_to:  # snapshots hold host tensors
            box = [rollback.snapshot if rollback is not None else None]
            dist.broadcast_object_list(box, src=0, group=self._control)
            results.append(ReplicatedRollback(box[0], rollback.done if rollback is not None else None))
            self._rollbacks_made += 1
        if verdicts:
            box = [verdict]
            dist.broadcast_object_list(box, src=0, group=self._control)
            results.append(box[0])
        with self._lock:
            self._results.extend(results)
        if results:
            self.wakeup()
        return bool(stop)

    def _sum_gradients(self, contribution: Contribution | None, entries: int, finite: bool) -> CombinedStep:
        """Every replica's gradients summed (zeros from this one without a contribution);
        on a GPU on the rounds' stream, after the device thread's writes, never on its."""
        stream = torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()
        with stream:
            if contribution is not None and contribution.ready is not None:
                self._stream.wait_event(contribution.ready)
            grads = contribution.grads if contribution is not None else torch.zeros(
                self._numel, dtype=torch.float32, device=self._device)
            dist.all_reduce(grads, group=self._group)
            done = None
            if self._stream is not None:
                done = torch.cuda.Event()
                done.record(self._stream)
        return CombinedStep(grads, entries, finite, contribution is not None, done)

    def _fail(self, reason: str, rollback: ReplicatedRollback | None, level: int) -> None:
        with self._lock:
            self.stopped = reason
            waiting, self._rollback = self._rollback, None
        if level >= logging.ERROR:  # (an agreed stop leaves the watermarks to every replica's `last_word`)
            self.fates.settle(failed=True)
        for pending in (rollback, waiting):
            if pending is not None and pending.done is not None and not pending.done.done():
                pending.done.set_exception(RuntimeError(reason))
        leaving = level >= logging.ERROR and not self._stop.is_set()  # (a shutdown's last round is no failure)
        logger.log(level, "replica %d: adapter sync stopped (%s)%s", self.rank, reason,
                   "; leaving the group (its agent, while it runs, restarts the group)" if leaving else "")
