"""Decides which sequences run in the next step and how many tokens each computes.

No tensors here. A step has a token budget (`max_num_batched_tokens`); running
sequences are served first (each needs one token when decoding, or the rest of its
prompt when its prefill was chunked), then waiting sequences are admitted in arrival
order while the budget, `max_num_seqs` and free KV blocks allow; a prompt larger than
what is left of the budget is prefilled in chunks over several steps, sharing those
steps with other sequences' decodes. When KV blocks run out, the most recently admitted
sequence is preempted: its blocks are freed and it is recomputed later (vLLM's policy).

A request's n choices share one prefill: in the step that completes choice 0's prompt,
the other choices fork it (`Fork`): they hold its full prompt blocks too (reference
counts) and get their own copy of its last, partial block, which they will write to
(copy-on-write, done at the fork since the first decode writes it at once). A choice
that cannot fork (no free block, `max_num_seqs` reached) is queued and prefilled alone.
A forked choice is an ordinary sequence afterwards: preempted, it recomputes alone.

With the prefix cache on (vLLM's automatic prefix caching), a sequence admitted to its
first prefill (or again after a preemption) takes the cached blocks that begin its tokens
(engine/block_pool.py) and computes only the rest; every full block a step computes is
named as the step is scheduled, so a prompt admitted later in the same step takes those it
shares (as in vLLM). A recorded prefill records only the rest too, its method permitting
(`RecordSpec.reads_cached_prefix`; the recorder is told the cached length when it admits
one); one reporting prompt log-probs reads nothing cached. Names start from the weights'
generation: when serving's weights change, every name is forgotten, and a sequence
admitted before names nothing more.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from engine.config import SchedulerConfig
from engine.block_pool import BlockPool, names_of_first_blocks
from engine.kv_cache import blocks_needed
from engine.recording import RecordSpec
from engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSequence:
    seq: Sequence
    # tokens computed for this sequence in this step, starting at seq.num_computed_tokens
    num_new_tokens: int

    @property
    def completes_pending(self) -> bool:
        """After this step every known token has K/V: the next token can be sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens

    @property
    def is_decode(self) -> bool:
        """One new token of a sequence past its prompt (read before the step runs)."""
        return self.num_new_tokens == 1 and self.seq.num_computed_tokens >= self.seq.num_prompt_tokens


# what a step runs (`SchedulerOutput.kind`)
STEP_KINDS = ("decode", "prefill", "mixed", "recorded_prefill", "recorded_mixed")


@dataclass
class Fork:
    """Choices that take `parent`'s prompt K/V in this step and sample their first token
    from its last prompt row."""

    parent: Sequence
    children: list[Sequence]
    # (source, destination) KV blocks to copy once the step has written the prompt
    block_copies: list[tuple[int, int]]


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    # sequences that lost their blocks this step
    preempted: list[Sequence] = field(default_factory=list)
    # a recorded prefill: exactly one sequence, its whole prompt, run with autograd
    recorded: bool = False
    # choices forking a prompt completed in this step
    forks: list[Fork] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def kind(self) -> str:
        """What the step runs (read before it runs): "decode" (one new token per sequence),
        "prefill" (no decode row: prompts, or a preempted sequence computing its tokens
        again), "mixed", "recorded_prefill" (a recorded prompt alone), "recorded_mixed" (one
        with running sequences riding along), or "" (nothing). A recorded step compares
        with the plain step of the same composition: prefill, or mixed."""
        if not self.scheduled:
            return ""
        if self.recorded:
            return "recorded_prefill" if len(self.scheduled) == 1 else "recorded_mixed"
        decodes = sum(s.is_decode for s in self.scheduled)
        return "decode" if decodes == len(self.scheduled) else "prefill" if not decodes else "mixed"


class Scheduler:
    def __init__(self, config: SchedulerConfig, num_blocks: int, block_size: int,
                 admit_recording: Callable[[Sequence, int], RecordSpec | None] | None = None,
                 confirm_recording: Callable[[Sequence, int], RecordSpec | None] | None = None,
                 prefix_caching: bool = False, weights_generation: Callable[[], int] | None = None):
        self.config = config
        # asked once per trainable sequence, before its first prefill, with the prompt tokens
        # the prefix cache holds for it now: record it, and how?
        self.admit_recording = admit_recording
        # asked again each time its recorded prefill is about to be scheduled (the weights
        # may have changed since it was admitted): the spec still holds, or None
        self.confirm_recording = confirm_recording
        self.block_size = block_size
        self.allocator = BlockPool(num_blocks)
        self.prefix_caching = prefix_caching
        # which weights serving runs with: a new value when they change (None: they never do)
        self.weights_generation = weights_generation
        self._generation = weights_generation() if weights_generation is not None else 0
        # prompt tokens looked up in the prefix cache, and those found, since `take_cache_counts`
        self._cache_queries = self._cache_hits = 0
        # the sequences the step being scheduled admitted or forked (`forget_unwritten`)
        self._admitted: list[Sequence] = []
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # running sequences sat out the last step, a recorded prefill's: the next is theirs
        self._running_sat_out = False

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Give `seq` blocks for `num_tokens` tokens in all; False if not enough are free."""
        missing = blocks_needed(num_tokens, self.block_size) - len(seq.block_ids)
        if missing <= 0:
            return True
        if missing > self.allocator.num_free:
            return False
        seq.block_ids.extend(self.allocator.allocate(missing))
        return True

    def _release(self, seq: Sequence) -> None:
        """Frees `seq`'s blocks (its full ones were cached as they were scheduled); its last
        blocks, the least likely to begin another prompt, are the first given to other tokens."""
        self.allocator.free(seq.block_ids[::-1])
        seq.block_ids = []

    # -- the prefix cache -------------------------------------------------------------

    def _follow_weights(self) -> None:
        """Forgets every cached name when the weights serving runs with have changed."""
        if self.weights_generation is not None:
            generation = self.weights_generation()
            if generation != self._generation:
                self._generation = generation
                self.allocator.forget_names()

    def _name_cacheable_blocks(self, seq: Sequence) -> int:
        """Names the blocks the prefix cache could give `seq` under today's weights (every
        full block but one holding its last token); returns the tokens it holds of them now,
        where `seq`'s prefill may read them (0 where it may not)."""
        if self.prefix_caching:
            # the last token is computed whatever is cached: its logits sample the next
            needed = (seq.num_tokens - 1) // self.block_size
            seq.block_names = names_of_first_blocks(seq, needed, self._generation, self.block_size)[:needed]
        seq.kv_generation = self._generation
        return len(self.allocator.cached_run(seq.block_names)) * self.block_size if self._reads_cache(seq) else 0

    def _begin_computing(self, seq: Sequence) -> None:
        """`seq` is admitted to compute its tokens from position 0 under today's weights: it
        takes the cached blocks that begin them, unless it reports prompt log-probs."""
        self._name_cacheable_blocks(seq)
        seq.num_named_blocks = 0
        if self._reads_cache(seq):
            seq.block_ids = self.allocator.take_cached_prefix(seq.block_names)
            seq.num_named_blocks = len(seq.block_ids)
            seq.num_computed_tokens = len(seq.block_ids) * self.block_size

    def _reads_cache(self, seq: Sequence) -> bool:
        """Whether `seq`'s prefill may take K/V from the prefix cache (one reporting prompt
        log-probs computes its whole prompt, as does one recorded for a method that trains
        only on recordings of the whole prompt)."""
        return (self.prefix_caching and seq.params.prompt_logprobs is None
                and (seq.record is None or seq.record.reads_cached_prefix))

    def _count_cache_lookup(self, seq: Sequence) -> None:
        """`seq` was admitted: its first prefill's cached tokens are what its request's usage
        reports; a lookup counts where the prefill could read the cache (as vLLM counts them)."""
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = seq.num_computed_tokens
            if self._reads_cache(seq):
                self._cache_queries += seq.num_prompt_tokens
                self._cache_hits += seq.num_computed_tokens

    def _give_back_cached_prefix(self, seq: Sequence) -> None:
        """Undoes `_begin_computing` for a sequence that could not be admitted after all."""
        self._release(seq)
        seq.num_computed_tokens, seq.num_named_blocks = 0, 0

    def _name_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Caches `seq`'s full blocks among its first `num_tokens` — those the step being
        scheduled computes, and those before them — under today's weights. A prompt admitted
        after it in the same step takes them, since each layer writes the step's K/V to the
        pool before any attention reads it (engine/kv_cache.py, `StepKV`); a step that fails
        forgets every name (`forget_unwritten`)."""
        full = num_tokens // self.block_size
        if not self.prefix_caching or full <= seq.num_named_blocks or seq.kv_generation != self._generation:
            return
        names = seq.block_names = names_of_first_blocks(seq, full, self._generation, self.block_size)
        for index in range(seq.num_named_blocks, full):
            self.allocator.name(seq.block_ids[index], names[index])
        seq.num_named_blocks = full

    def forget_unwritten(self) -> None:
        """A step failed, or its scheduling did: blocks named for what it was to compute may
        hold anything. Every name goes (the next steps name what they compute), and every
        sequence the step admitted or forked, which may count such blocks as computed, starts
        again from its first token, as a preempted one does."""
        self.allocator.forget_names()
        for seq in reversed(self._admitted):
            if seq in self.running:
                self.running.remove(seq)
                self.allocator.free(seq.block_ids[::-1])
                seq.block_ids, seq.num_computed_tokens = [], 0
                seq.status = SequenceStatus.WAITING
                self.waiting.appendleft(seq)
        for seq in self.running:
            seq.num_named_blocks = 0

    def take_cache_counts(self) -> tuple[int, int]:
        """Prompt tokens looked up in the prefix cache and found there since the last call."""
        counts = self._cache_queries, self._cache_hits
        self._cache_queries = self._cache_hits = 0
        return counts

    def _preempt(self, seq: Sequence, output: SchedulerOutput) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        output.preempted.append(seq)

    def _schedule_recorded_prefill(self) -> SchedulerOutput | None:
        """A sequence selected for training is prefilled whole (not chunked), first in its
        step, so its graph covers exactly its prompt (after its cached beginning, where its
        method reads one). Decoding sequences ride along in its forward, one token each
        (engine/model_runner.py); with `recorded_prefill_alone`, and those that could not
        ride, they take the next step, before any other recorded prefill (`schedule`): a
        prompt prefilled in chunks waits one recorded prefill at most, not a queue of them."""
        if not self.waiting or len(self.running) >= self.config.max_num_seqs:
            return None
        seq = self.waiting[0]
        if seq.num_computed_tokens != 0:
            return None
        self._decide_recording(seq)
        if seq.record is not None and self.confirm_recording is not None:
            seq.record = self.confirm_recording(seq, self._name_cacheable_blocks(seq))
        if seq.record is None:
            return None
        self._begin_computing(seq)
        if not self._grow(seq, seq.num_tokens):
            self._give_back_cached_prefix(seq)
            return None
        self.waiting.popleft()
        self._count_cache_lookup(seq)
        decoding = [s for s in self.running if s.num_pending_tokens == 1]
        join = not self.config.recorded_prefill_alone
        decodes = [ScheduledSequence(s, 1) for s in decoding if join and self._grow(s, s.num_tokens)]
        self._running_sat_out = len(decodes) < len(self.running)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        scheduled = [ScheduledSequence(seq, seq.num_tokens - seq.num_computed_tokens)] + decodes
        for entry in scheduled:
            self._name_blocks(entry.seq, entry.seq.num_computed_tokens + entry.num_new_tokens)
        return SchedulerOutput(scheduled, recorded=True)

    def _decide_recording(self, seq: Sequence) -> None:
        """Asks, once, whether a trainable sequence's first prefill is recorded."""
        if seq.awaits_admission:
            seq.awaits_admission = False
            if self.admit_recording is not None:  # (no spec yet: the tokens its prefill could read)
                seq.record = self.admit_recording(seq, self._name_cacheable_blocks(seq))

    def _fork(self, output: SchedulerOutput) -> None:
        """Forks the waiting choices of every prompt this step completes."""
        for entry in output.scheduled:
            parent = entry.seq
            if not parent.fork_children or not entry.completes_pending:
                continue
            children, parent.fork_children = parent.fork_children, []
            num_full, partial = divmod(parent.num_prompt_tokens, self.block_size)
            fork = Fork(parent, [], [])
            for child in children:
                child.fork_parent = None
                if len(self.running) >= self.config.max_num_seqs or (partial and self.allocator.num_free == 0):
                    self.waiting.appendleft(child)  # prefilled alone, as soon as there is room
                    continue
                self.allocator.share(parent.block_ids[:num_full])
                child.block_ids = parent.block_ids[:num_full]
                if partial:
                    own = self.allocator.allocate(1)[0]
                    child.block_ids = child.block_ids + [own]
                    fork.block_copies.append((parent.block_ids[num_full], own))
                child.num_computed_tokens = parent.num_prompt_tokens
                child.kv_generation, child.num_cached_tokens = parent.kv_generation, parent.num_cached_tokens
                child.block_names = parent.block_names[:num_full]
                child.status = SequenceStatus.RUNNING
                self.running.append(child)
                self._admitted.append(child)
                fork.children.append(child)
            if fork.children:
                output.forks.append(fork)

    def schedule(self) -> SchedulerOutput:
        self._admitted.clear()
        self._follow_weights()
        # running sequences that sat out a recorded prefill's step take the next one, before any other
        recorded = None if self._running_sat_out else self._schedule_recorded_prefill()
        output = recorded or self._schedule_batch()
        self._fork(output)
        return output

    def _schedule_batch(self) -> SchedulerOutput:
        self._running_sat_out = False
        output = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        # Running sequences first, oldest first; the newest is preempted when blocks run out.
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_new = min(seq.num_pending_tokens, budget)
            while not self._grow(seq, seq.num_computed_tokens + num_new):
                victim = self.running[-1]
                self._preempt(victim, output)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break
            output.scheduled.append(ScheduledSequence(seq, num_new))
            self._name_blocks(seq, seq.num_computed_tokens + num_new)
            budget -= num_new
            index += 1
        if output.preempted:
            return output
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_computed_tokens == 0:
                self._decide_recording(seq)  # a trainable request not recorded joins this step like any other
                if seq.record is not None:
                    break  # waits for a step of its own (see _schedule_recorded_prefill)
                self._begin_computing(seq)
            num_new = min(seq.num_pending_tokens, budget)
            if not self._grow(seq, seq.num_computed_tokens + num_new):
                self._give_back_cached_prefix(seq)  # (a waiting sequence holds only cached blocks)
                break
            self.waiting.popleft()
            self._admitted.append(seq)
            self._count_cache_lookup(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            output.scheduled.append(ScheduledSequence(seq, num_new))
            self._name_blocks(seq, seq.num_computed_tokens + num_new)
            budget -= num_new
        return output

    def finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        """Mark `seq` finished and free its blocks (it may be running or waiting)."""
        if seq.is_finished:
            return
        if seq.fork_parent is not None:  # still waiting to fork
            seq.fork_parent.fork_children.remove(seq)
            seq.fork_parent = None
        for child in seq.fork_children:  # never left without a prompt: prefilled alone
            child.fork_parent = None
            self.waiting.appendleft(child)
        seq.fork_children = []
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.allocator.num_free / max(self.allocator.num_blocks, 1)
