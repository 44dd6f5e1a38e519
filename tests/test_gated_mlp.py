"""The gated MLP's activation saving gate and up only (engine/gated_mlp.py): the model's
own values and gradients to the bit, one intermediate-wide tensor less per token and
layer in a recording."""

import pytest
import torch

from engine.gated_mlp import SiluAndMul, install_gated_mlp
from tests.conftest import make_training
from tests.test_training import serve
from tests.tiny import FAMILIES, tiny_model
from trainer.config import TrainConfig


def _mlps(model) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("MLP")]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gated_mlp_equals_the_models_own_to_the_bit(family, dtype):
    """Output, input gradient and weight gradients with grad; output in inference mode."""
    model = tiny_model(family, dtype=dtype)
    mlp = _mlps(model)[0]
    x = torch.randn(1, 9, model.config.hidden_size, generator=torch.Generator().manual_seed(1)).to(dtype)
    grad = torch.randn_like(x)

    def run():
        mlp.zero_grad(set_to_none=True)
        leaf = x.clone().requires_grad_()
        out = mlp(leaf)
        out.backward(grad)
        with torch.inference_mode():
            served = mlp(x)
        return [out.detach(), leaf.grad, served] + [p.grad for p in mlp.parameters()]

    own = run()
    assert install_gated_mlp(model) == model.config.num_hidden_layers
    assert type(mlp).__name__.startswith("Gated")
    gated = run()
    assert all(torch.equal(a, b) for a, b in zip(own, gated))


def test_silu_and_mul_saves_gate_and_up_only():
    gate = torch.randn(5, 8, requires_grad=True)
    up = torch.randn(5, 8, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        SiluAndMul.apply(gate, up).sum().backward()
    assert len(saved) == 2 and saved[0] is gate and saved[1] is up


@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_a_recording_keeps_one_intermediate_wide_tensor_less_per_token_and_layer(family):
    trainer = make_training(TrainConfig(mode="cpt", lora_rank=4), family=family, init_lora_weights=False)
    model = trainer.peft_model
    serve(trainer, "gated", max_tokens=1)
    gated = trainer.cache.get("gated")
    for mlp in _mlps(model):  # back to the family's own class
        mlp.__class__ = type(mlp).__mro__[1]
    serve(trainer, "own", max_tokens=1)
    own = trainer.cache.get("own")
    config = model.config
    tokens = len(own.prompt_token_ids)
    assert own.recording.saved_bytes - gated.recording.saved_bytes == \
        config.num_hidden_layers * tokens * config.intermediate_size * 4
