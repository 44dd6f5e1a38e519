"""The scheduler without tensors: budgets, admission, chunked prefill, preemption."""

from engine.config import SchedulerConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.recording import RecordSpec
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus


def create_scheduler(max_num_seqs=4, max_num_batched_tokens=16, num_blocks=32, block_size=4) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs, max_num_batched_tokens), num_blocks, block_size)


def create_sequence(seq_id: int, prompt_len: int, max_tokens: int = 8) -> Sequence:
    return Sequence(seq_id=seq_id, request_id=f"r{seq_id}", index=0, prompt_token_ids=list(range(prompt_len)),
                    params=SamplingParams(max_tokens=max_tokens), max_tokens=max_tokens, arrival_time=0.0,
                    detokenizer=IncrementalDetokenizer(None, [], [], False, True))


def complete_step(scheduler: Scheduler, output) -> None:
    """What the engine's update does with the counters: compute, and sample a token
    for each sequence whose pending tokens are done."""
    for entry in output.scheduled:
        done = entry.completes_pending
        entry.seq.num_computed_tokens += entry.num_new_tokens
        if done:
            entry.seq.output_token_ids.append(0)


def test_long_prompt_is_prefilled_in_chunks_within_the_budget():
    scheduler = create_scheduler(max_num_batched_tokens=16)
    seq = create_sequence(0, prompt_len=40)
    scheduler.add(seq)
    chunks = []
    while not seq.output_token_ids:
        out = scheduler.schedule()
        assert out.num_tokens <= 16
        chunks.append(out.scheduled[0].num_new_tokens)
        complete_step(scheduler, out)
    assert chunks == [16, 16, 8]
    assert scheduler.schedule().scheduled[0].num_new_tokens == 1  # then decode


def test_decodes_share_a_step_with_a_new_prefill():
    scheduler = create_scheduler(max_num_batched_tokens=16)
    first = create_sequence(0, prompt_len=6)
    scheduler.add(first)
    complete_step(scheduler, scheduler.schedule())
    scheduler.add(create_sequence(1, prompt_len=30))
    out = scheduler.schedule()
    assert [(e.seq.seq_id, e.num_new_tokens) for e in out.scheduled] == [(0, 1), (1, 15)]


def test_max_num_seqs_bounds_the_running_batch():
    scheduler = create_scheduler(max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(4):
        scheduler.add(create_sequence(i, prompt_len=3))
    out = scheduler.schedule()
    assert len(out.scheduled) == 2 and len(scheduler.waiting) == 2


def test_out_of_blocks_preempts_the_newest_and_it_is_recomputed_later():
    scheduler = create_scheduler(max_num_batched_tokens=64, num_blocks=4, block_size=4)
    old, new = create_sequence(0, prompt_len=7), create_sequence(1, prompt_len=7)
    scheduler.add(old)
    scheduler.add(new)
    complete_step(scheduler, scheduler.schedule())  # both prefilled: 2 blocks each, all 4 used
    complete_step(scheduler, scheduler.schedule())  # both decode token 8: still fits
    out = scheduler.schedule()  # token 9 needs a third block for each: newest is preempted
    assert out.preempted == [new]
    assert new.status is SequenceStatus.WAITING and new.num_computed_tokens == 0 and not new.block_ids
    assert [e.seq for e in out.scheduled] == [old]
    scheduler.finish(old, "length")
    out = scheduler.schedule()
    assert out.scheduled[0].seq is new and out.scheduled[0].num_new_tokens == new.num_tokens  # recompute
    assert scheduler.allocator.num_free == 4 - 3


def test_finish_frees_blocks():
    scheduler = create_scheduler()
    seq = create_sequence(0, prompt_len=9)
    scheduler.add(seq)
    scheduler.schedule()
    assert scheduler.allocator.num_free == 32 - 3
    scheduler.finish(seq, "abort")
    assert scheduler.allocator.num_free == 32 and not scheduler.has_unfinished()


def test_recording_is_decided_once_by_the_admission_callback_before_the_first_prefill():
    asked = []

    def admit(seq, num_cached_tokens):
        asked.append(seq.seq_id)
        return RecordSpec(all_logit_rows=True, adapter_version=7) if seq.seq_id == 0 else None

    scheduler = Scheduler(SchedulerConfig(4, 16), 64, 4, admit_recording=admit)
    recorded, refused, plain = (create_sequence(i, prompt_len=40) for i in range(3))
    recorded.awaits_admission = refused.awaits_admission = True
    for seq in (recorded, refused, plain):
        scheduler.add(seq)
    out = scheduler.schedule()  # admitted: the whole prompt in a step of its own, over the token budget
    assert out.recorded and [e.seq for e in out.scheduled] == [recorded] and out.num_tokens == 40
    assert recorded.record.adapter_version == 7
    complete_step(scheduler, out)
    recorded.record = None  # the engine clears it once the recording is made
    chunks = []
    while not (refused.output_token_ids and plain.output_token_ids):
        out = scheduler.schedule()
        assert not out.recorded
        chunks += [(e.seq.seq_id, e.num_new_tokens) for e in out.scheduled if e.seq is not recorded]
        complete_step(scheduler, out)
    assert asked == [0, 1]  # once each, and never for a request that is not trainable
    assert refused.record is None and not refused.track_logprob
    assert (1, 15) in chunks  # refused: served like any other request, chunked to the budget


def test_trainable_requests_not_recorded_join_one_step_together():
    """Requests arriving together while another decodes: those the admission does not
    record are prefilled in one step, as untrainable ones are (each took a step of its
    own before: a burst of 32 over HTTP cost the running streams 31 mixed steps)."""
    asked = []

    def admit(seq, num_cached_tokens):
        asked.append(seq.seq_id)
        return RecordSpec(all_logit_rows=True, adapter_version=1) if seq.seq_id == 3 else None

    scheduler = Scheduler(SchedulerConfig(8, 64), 64, 4, admit_recording=admit)
    first = create_sequence(0, prompt_len=5)
    scheduler.add(first)
    complete_step(scheduler, scheduler.schedule())
    burst = [create_sequence(i, prompt_len=6) for i in range(1, 5)]
    for seq in burst:
        seq.awaits_admission = True
        scheduler.add(seq)
    out = scheduler.schedule()
    assert [(e.seq.seq_id, e.num_new_tokens) for e in out.scheduled] == [(0, 1), (1, 6), (2, 6)]
    assert not out.recorded and burst[2].record is not None  # 3 is recorded: it waits for a step of its own
    complete_step(scheduler, out)
    out = scheduler.schedule()
    assert out.recorded and [e.seq.seq_id for e in out.scheduled][0] == 3
    complete_step(scheduler, out)
    burst[2].record = None  # the engine clears it once the recording is made
    while scheduler.waiting:  # 4, behind the recorded one, joins the next batch
        complete_step(scheduler, scheduler.schedule())
    assert asked == [1, 2, 3, 4]  # once each


def test_a_request_not_recorded_that_finds_no_blocks_is_not_asked_again():
    asked = []

    def admit(seq, num_cached_tokens):
        asked.append(seq.seq_id)
        return None

    scheduler = Scheduler(SchedulerConfig(8, 64), 3, 4, admit_recording=admit)  # 3 blocks of 4 tokens
    first = create_sequence(0, prompt_len=8)
    scheduler.add(first)
    complete_step(scheduler, scheduler.schedule())
    late = create_sequence(1, prompt_len=6)
    late.awaits_admission = True
    scheduler.add(late)
    out = scheduler.schedule()  # 1 block left: its 6 tokens do not fit; it waits, decided
    assert [e.seq.seq_id for e in out.scheduled] == [0] and scheduler.waiting[0] is late
    scheduler.finish(first, "length")
    complete_step(scheduler, out)
    out = scheduler.schedule()
    assert [e.seq.seq_id for e in out.scheduled] == [1] and asked == [1]
