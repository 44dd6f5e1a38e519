"""`direct_apply` (engine/direct_apply.py): an autograd Function applied without its
Python wrapper builds the same graph and gives the same gradients, falls back to the
wrapper under functorch's transforms, and leaves a recorded prefill's Python calls
within a bound of a plain prefill's — on the CPU's merged path and the training copies'."""

import cProfile
import pstats

import pytest
import torch
from torch import nn

from engine.direct_apply import direct_apply
from engine.sampling_params import SamplingParams
from tests.conftest import encode, engine_of, make_training
from tests.test_adapter import CPU_ONLY
from tests.test_saved_bytes_memo import PATHS, PROMPT
from tests.test_training import gradients_of, serve
from trainer.adapter import LeanLoraLinear, lora_parameters, records_through_merged
from trainer.config import TrainConfig


class _Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.factor = factor
        return x * w * factor

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, w = ctx.saved_tensors
        return grad * w * ctx.factor, grad * x * ctx.factor, None


def test_the_same_graph_and_gradients_as_the_wrapper():
    grads = []
    for apply in (_Scale.apply, direct_apply(_Scale)):
        x = torch.arange(4.0, requires_grad=True)
        w = torch.full((4,), 0.5, requires_grad=True)
        out = apply(x, w, 3.0)
        assert type(out.grad_fn).__name__ == "_ScaleBackward"
        out.pow(2).sum().backward()
        grads.append((out.detach(), x.grad, w.grad))
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_under_a_functorch_transform_it_takes_the_wrappers_route():
    x = torch.arange(3.0)
    for apply in (_Scale.apply, direct_apply(_Scale)):
        # the wrapper refuses a Function without setup_context there; so does the direct apply, not silently wrong
        with pytest.raises(RuntimeError, match="setup_context"):
            torch.func.grad(lambda t: apply(t, torch.ones(3), 2.0).sum())(x)


def test_a_function_with_setup_context_is_refused():
    class WithSetup(torch.autograd.Function):
        @staticmethod
        def forward(x):
            return x * 2

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

    with pytest.raises(AssertionError, match="setup_context"):
        direct_apply(WithSetup)


def _prefill_calls(trainer, request_id: str, recorded: bool) -> int:
    """The Python calls of the prefill step of `PROMPT`, served recorded or not."""
    engine = engine_of(trainer)
    engine.add_request(request_id, encode(PROMPT), SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
                       train=recorded)
    profile = cProfile.Profile()
    profile.enable()
    engine.step()
    profile.disable()
    while engine.has_unfinished():
        engine.step()
    return sum(stat[1] for stat in pstats.Stats(profile).stats.values())


@pytest.mark.parametrize("path", [p if p != "merged" else pytest.param(p, marks=CPU_ONLY) for p in PATHS])
def test_a_recorded_prefill_costs_the_host_few_python_calls_more_than_a_plain_one(path):
    """Each adapted layer's recorded forward is one autograd Function applied directly,
    its weights read from plain attributes: on these 8-layer models a recorded prefill
    made 27 (training copies) and 47 (merged) Python calls per adapted layer more than a
    plain one before; on a GPU each is host time."""
    torch.manual_seed(0)
    config = TrainConfig(mode="dpo", lora_rank=4, lora_compute_dtype="model")
    trainer = make_training(config, dtype=torch.bfloat16 if path == "copies" else torch.float32, num_layers=8,
                            init_lora_weights=False)
    adapted = sum(isinstance(m, LeanLoraLinear) for m in trainer.peft_model.modules())
    for warm in range(2):  # the copies, the shapes, the saved-bytes memo
        serve(trainer, f"warm-{warm}", max_tokens=2)
        _prefill_calls(trainer, f"plain-warm-{warm}", recorded=False)
    recorded, plain = _prefill_calls(trainer, "recorded", True), _prefill_calls(trainer, "plain", False)
    assert (recorded - plain) / adapted <= 22, (recorded, plain, adapted)


@CPU_ONLY
def test_a_replaced_lora_weight_is_recorded_and_trained_as_itself():
    """A LoRA parameter replaced by another (not changed in place) is not what the merged
    copy stands for: the recorded forward takes PEFT's path with the new weight, the
    gradient lands on it, and a recording does not pass for one of activations only."""
    trainers = []
    for _ in range(2):
        torch.manual_seed(0)
        trainers.append(make_training(TrainConfig(mode="cpt", lora_rank=4), init_lora_weights=False))
    trainer, reference = trainers
    layer, twin = (next(m for m in t.peft_model.modules() if isinstance(m, LeanLoraLinear)) for t in trainers)
    new = nn.Parameter(layer.lora_A["default"].weight.detach() + 0.05)
    assert records_through_merged([layer], torch.float32)
    layer.lora_A["default"].weight = new
    assert not records_through_merged([layer], torch.float32)
    with torch.no_grad():
        twin.lora_A["default"].weight.copy_(new)  # in place: its merged copy is rebuilt with these values
    for t in trainers:
        serve(t, "r", max_tokens=1)  # the one token sampled from the recorded prefill
    got = gradients_of(trainer, trainer.method.reuse_job(trainer.cache.get("r"), trainer.context))
    expected = gradients_of(reference, reference.method.reuse_job(reference.cache.get("r"), reference.context))
    assert any(p is new for p in lora_parameters(trainer.peft_model))
    assert got.keys() == expected.keys()
    assert all(torch.allclose(got[k], expected[k], atol=1e-6) for k in expected)
