"""One top-down backward sweep (suffixes and prompt layer by layer) against two (the
suffixes', then the prompt's): the same LoRA gradients for DPO and a GRPO group, offloaded
or not, and the order the layers are back-propagated in."""

import pytest

import trainer.forward as forward
from offload.config import OffloadConfig
from tests.test_grpo import make_trainer as make_grpo_trainer, reward, serve_group
from tests.test_training import gradients_of, label, make_trainer, relative_difference, serve


def _dpo_entry(trainer, request_id="r"):
    serve(trainer, request_id, max_tokens=8)
    label(trainer, request_id, chosen="Paris, of course. It is a lovely city.")
    return trainer.cache.get(request_id)


def _grpo_entry(trainer, request_id="g"):
    serve_group(trainer, request_id)
    assert reward(trainer, request_id).accepted
    return trainer.cache.get(request_id)


def _gradients(mode: str, one_sweep: bool, offload=None) -> dict:
    if mode == "dpo":
        trainer = make_trainer(mode="dpo", one_backward_sweep=one_sweep)
        entry = _dpo_entry(trainer)
    else:
        trainer = make_grpo_trainer(offload=offload, one_backward_sweep=one_sweep)
        entry = _grpo_entry(trainer)
        if offload is not None:
            trainer.offloader.free_to(0)  # every layer comes back for its backward
    assert trainer.context.one_backward_sweep is one_sweep
    return gradients_of(trainer, trainer.method.reuse_job(entry, trainer.context))


@pytest.mark.parametrize("mode", ["dpo", "grpo"])
def test_one_sweep_gives_the_two_sweeps_gradients(mode):
    one, two = _gradients(mode, True), _gradients(mode, False)
    assert set(one) == set(two) and all(g.norm() > 0 for g in two.values())
    assert relative_difference(one, two) <= 1e-6


@pytest.mark.parametrize("policy", ["load", "recompute"])
def test_with_every_prompt_layer_offloaded_the_gradients_are_the_same(policy):
    offload = OffloadConfig(device_budget_bytes=1 << 40, policy=policy)
    assert relative_difference(_gradients("grpo", True, offload), _gradients("grpo", False)) <= 1e-5


@pytest.mark.parametrize("mode, one_sweep, offload", [("dpo", True, False), ("dpo", False, False),
                                                      ("grpo", True, False), ("grpo", False, False),
                                                      ("grpo", True, True)])
def test_layers_are_back_propagated_in_the_schedules_order(monkeypatch, mode, one_sweep, offload):
    """One sweep: at each layer, top first, the responses' backward then the prompt's;
    two: every response layer, then every prompt layer — and two with a device budget,
    whose reloads of prompt layers are not budgeted beside the suffixes' graphs."""
    if mode == "dpo":
        trainer = make_trainer(mode="dpo", one_backward_sweep=one_sweep)
        entry = _dpo_entry(trainer)
    else:
        budget = OffloadConfig(device_budget_bytes=1 << 40) if offload else None
        trainer = make_grpo_trainer(offload=budget, one_backward_sweep=one_sweep)
        entry = _grpo_entry(trainer)
    one_sweep = one_sweep and not offload
    prompt_segments = entry.recording.segments
    order = []
    plain = forward.backward_layer

    def logged(segments, index, *args, **kwargs):
        order.append(("prompt" if segments is prompt_segments else "responses", index))
        return plain(segments, index, *args, **kwargs)

    monkeypatch.setattr(forward, "backward_layer", logged)
    gradients_of(trainer, trainer.method.reuse_job(entry, trainer.context))
    layers = list(reversed(range(len(prompt_segments))))
    if one_sweep:
        assert order == [(part, i) for i in layers for part in ("responses", "prompt")]
    else:
        assert order == [("responses", i) for i in layers] + [("prompt", i) for i in layers]
    assert all(segment is None for segment in prompt_segments)
