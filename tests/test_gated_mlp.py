"""The gated MLP's activation saving gate and up only (engine/gated_mlp.py), and the down
projection's LoRA functions forming their input again from them: the model's own values
and gradients to the bit, two intermediate-wide tensors less per token and layer in a
recording."""

import pytest
import torch

from engine.gated_mlp import GELU_TANH, SILU, ActAndMul, install_gated_mlp
from engine.saved_bytes_memo import SavedBytesMemo
from tests.conftest import engine_of, make_training
from tests.test_training import gradients_of, serve
from tests.tiny import FAMILIES, TEST_DEVICE, tiny_model
from trainer.config import TrainConfig


def _mlps(model) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("MLP")]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gated_mlp_equals_the_models_own_to_the_bit(family, dtype):
    """Output, input gradient and weight gradients with grad; output in inference mode."""
    model = tiny_model(family, dtype=dtype)
    mlp = _mlps(model)[0]
    x = torch.randn(1, 9, model.config.hidden_size, generator=torch.Generator().manual_seed(1)).to(TEST_DEVICE, dtype)
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


@pytest.mark.parametrize("kind", [SILU, GELU_TANH])
def test_act_and_mul_saves_gate_and_up_only(kind):
    gate = torch.randn(5, 8, requires_grad=True)
    up = torch.randn(5, 8, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        ActAndMul.apply(gate, up, kind).sum().backward()
    assert len(saved) == 2 and saved[0] is gate and saved[1] is up


# the same prompt served twice, each recording of the whole prompt (not after the first's cached beginning)
WHOLE_RECORDINGS = TrainConfig(mode="cpt", lora_rank=4, lora_compute_dtype="model", record_after_cached_prefix=False)


def _own_mlps(model) -> None:
    for mlp in _mlps(model):  # back to the family's own class
        if type(mlp).__name__.startswith("Gated"):
            mlp.__class__ = type(mlp).__mro__[1]


@pytest.mark.parametrize("family", ["llama", "phi3", "gemma3_text"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_recording_keeps_two_intermediate_wide_tensors_less_per_token_and_layer(family, dtype):
    """silu(gate) (autograd's `*` saved it) and the product (the down projection's LoRA
    function saved it: the merged one in float32, the training copies' in bfloat16)."""
    trainer = make_training(WHOLE_RECORDINGS, family=family,
                            dtype=dtype, init_lora_weights=False)
    model = trainer.peft_model
    serve(trainer, "gated", max_tokens=1)
    gated = trainer.cache.get("gated")
    _own_mlps(model)
    runner = engine_of(trainer).runner
    if runner.saved_bytes_memo is not None:  # it stands for one model's code: the MLPs just changed theirs
        runner.saved_bytes_memo = SavedBytesMemo()
    serve(trainer, "own", max_tokens=1)
    own = trainer.cache.get("own")
    config = model.config
    tokens = len(own.prompt_token_ids)
    # a float32 model on a GPU runs PEFT's own LoRA layers (no merge, no copies), whose down
    # projection saves the product: only silu(gate) is kept less there
    kept_less = 1 if TEST_DEVICE.type != "cpu" and dtype == torch.float32 else 2
    assert own.recording.saved_bytes - gated.recording.saved_bytes == \
        kept_less * config.num_hidden_layers * tokens * config.intermediate_size * dtype.itemsize


@pytest.mark.parametrize("family", ["llama", "phi3", "gemma3_text"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_adapters_gradients_are_the_models_own_to_the_bit(family, dtype):
    """Reuse (the recorded prefill's backward) and recompute, through the merged LoRA
    function (float32) and the training copies (bfloat16): the product formed again in
    the down projection's backward gives the gradients the model's own MLP gives."""
    trainer = make_training(WHOLE_RECORDINGS, family=family,
                            dtype=dtype, init_lora_weights=False)
    grads = {}
    for name in ("gated", "own"):
        if name == "own":
            _own_mlps(trainer.peft_model)
        serve(trainer, name, max_tokens=1)
        entry = trainer.cache.get(name)
        grads[name, "recompute"] = gradients_of(trainer, trainer.method.recompute_job(entry, trainer.context))
        grads[name, "reuse"] = gradients_of(trainer, trainer.method.reuse_job(entry, trainer.context))
    for path in ("recompute", "reuse"):
        gated, own = grads["gated", path], grads["own", path]
        assert set(gated) == set(own) and all(torch.equal(gated[k], own[k]) for k in own), path


def test_a_product_changed_in_place_before_the_down_projection_is_saved_as_autograd_would():
    """A hook that edits the down projection's input in place: the product is no longer
    silu(gate) * up, so the LoRA function saves what it was given, and the gradients are
    those of the model's own MLP under the same hook."""
    trainer = make_training(WHOLE_RECORDINGS, dtype=torch.bfloat16,
                            init_lora_weights=False)
    def double_in_place(module, args):
        args[0].mul_(2)

    for mlp in _mlps(trainer.peft_model):
        mlp.down_proj.register_forward_pre_hook(double_in_place)
    grads = {}
    for name in ("gated", "own"):
        if name == "own":
            _own_mlps(trainer.peft_model)
        serve(trainer, name, max_tokens=1)
        grads[name] = gradients_of(trainer, trainer.method.reuse_job(trainer.cache.get(name), trainer.context))
    assert all(torch.equal(grads["gated"][k], grads["own"][k]) for k in grads["own"])
