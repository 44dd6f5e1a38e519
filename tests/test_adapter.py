"""The LoRA adapter: its lean inference path equals PEFT's forward."""

import pytest
import torch

from trainer.config import TrainConfig
from tests.conftest import encode, make_engine
from tests.tiny import FAMILIES, TEST_DEVICE, tiny_model

# merged serving packs weights through oneDNN: a CPU path
CPU_ONLY = pytest.mark.skipif(TEST_DEVICE.type != "cpu", reason="oneDNN merged serving is a CPU path")
from trainer.adapter import LeanLoraLinear, attach_lora


@pytest.mark.parametrize("family", FAMILIES)
def test_lean_inference_forward_equals_peft_forward(family):
    engine = make_engine(family)
    peft_model = attach_lora(engine.model, TrainConfig(mode="cpt", lora_rank=4), init_lora_weights=False)
    layers = [m for m in peft_model.modules() if isinstance(m, LeanLoraLinear)]
    assert layers
    x = torch.randn(1, 5, layers[0].in_features, device=TEST_DEVICE)
    for layer in layers[:3]:
        x = torch.randn(1, 5, layer.in_features, device=TEST_DEVICE)
        with torch.inference_mode():
            lean = layer(x)
        with torch.no_grad(), torch.enable_grad():  # grad mode on: PEFT's own forward
            reference = layer(x).detach()
        assert torch.allclose(lean, reference, atol=1e-5)
    ids = torch.tensor([encode("Hello there, how are you?")], device=TEST_DEVICE)
    with torch.inference_mode():
        lean_logits = peft_model(ids).logits
    with torch.enable_grad():
        reference_logits = peft_model(ids).logits.detach()
    assert torch.allclose(lean_logits, reference_logits, atol=1e-4)
    with peft_model.disable_adapter(), torch.inference_mode():
        base_logits = peft_model(ids).logits
    assert not torch.allclose(base_logits, lean_logits, atol=1e-3)  # the adapter really acts


@CPU_ONLY
def test_merged_serving_equals_lean_and_goes_stale_with_the_weights():
    from trainer.adapter import merge_stale

    engine = make_engine("qwen2")  # biased projections through the merged GEMM too
    peft_model = attach_lora(engine.model, TrainConfig(mode="cpt", lora_rank=4), init_lora_weights=False)
    layers = [m for m in peft_model.modules() if isinstance(m, LeanLoraLinear)]
    ids = torch.tensor([encode("Hello there, how are you?")], device=TEST_DEVICE)
    with torch.inference_mode():
        lean_logits = peft_model(ids).logits
    keys = list(peft_model.state_dict())
    while merge_stale(peft_model, budget_s=0.01):  # a slice at a time, as between jobs
        pass
    assert all(layer.merged_is_current() for layer in layers)
    assert list(peft_model.state_dict()) == keys  # the pack and the bias it holds are no parameters
    with torch.inference_mode():
        merged_logits = peft_model(ids).logits
    assert torch.allclose(merged_logits, lean_logits, atol=1e-4)
    with torch.no_grad():
        layers[0].lora_B["default"].weight.add_(0.5)  # what an optimizer step does
    assert not layers[0].merged_is_current() and layers[1].merged_is_current()
    with torch.inference_mode():
        updated = peft_model(ids).logits  # layer 0 lean (new weights), the rest merged
    with torch.enable_grad():
        reference = peft_model(ids).logits.detach()  # PEFT's forward, all current weights
    assert torch.allclose(updated, reference, atol=1e-4)
    assert not torch.allclose(updated, merged_logits, atol=1e-3)
    with peft_model.disable_adapter():
        with torch.inference_mode():
            disabled = peft_model(ids).logits
        with torch.enable_grad():
            disabled_reference = peft_model(ids).logits.detach()
    assert torch.allclose(disabled, disabled_reference, atol=1e-5)
    assert not torch.allclose(disabled, updated, atol=1e-3)  # the merged copies were not used
    from trainer.adapter import adapters_disabled
    with adapters_disabled(peft_model), torch.inference_mode():
        assert torch.allclose(peft_model(ids).logits, disabled_reference, atol=1e-5)
    with torch.inference_mode():
        assert torch.allclose(peft_model(ids).logits, updated, atol=1e-5)  # restored


@CPU_ONLY
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_merged_autograd_forward_gives_peft_outputs_and_gradients(family):
    """With grad enabled and a current merged copy, a layer forwards through the merged
    GEMM and forms the LoRA products in backward: same output and same gradients for the
    input, A and B as PEFT's own forward."""
    from trainer.adapter import merge_stale

    engine = make_engine(family)
    peft_model = attach_lora(engine.model, TrainConfig(mode="cpt", lora_rank=4), init_lora_weights=False)
    while merge_stale(peft_model, budget_s=0.01):  # a slice at a time, as between jobs
        pass
    for layer in [m for m in peft_model.modules() if isinstance(m, LeanLoraLinear)][:4]:
        a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
        x = torch.randn(1, 7, layer.in_features)
        g = torch.randn(1, 7, layer.out_features)
        results = []
        for merged in (True, False):
            if not merged:
                layer._merged_pack = None  # PEFT's forward
            xi = x.clone().requires_grad_()
            a.grad = b.grad = None
            with torch.enable_grad():
                out = layer(xi)
                assert (type(out.grad_fn).__name__ == "_MergedLoraFunctionBackward") == merged
                out.backward(g)
            results.append((out.detach(), xi.grad, a.grad.clone(), b.grad.clone()))
        for fast, reference in zip(*results):
            assert torch.allclose(fast, reference, rtol=1e-5, atol=1e-5)


def test_lean_forward_on_a_bfloat16_model_with_its_float32_adapter_equals_peft():
    """The GPU serving dtype: PEFT keeps the adapter in float32 beside bfloat16 weights;
    the lean path must cast as PEFT does (it failed on the first CUDA run)."""
    from tests.tiny import tiny_model
    model = tiny_model("llama", dtype=torch.bfloat16)
    peft_model = attach_lora(model, TrainConfig(mode="cpt", lora_rank=4), init_lora_weights=False)
    layer = next(m for m in peft_model.modules() if isinstance(m, LeanLoraLinear))
    assert layer.lora_A["default"].weight.dtype == torch.float32 and layer.base_layer.weight.dtype == torch.bfloat16
    x = torch.randn(1, 5, layer.in_features, dtype=torch.bfloat16, device=layer.base_layer.weight.device)
    with torch.inference_mode():
        lean = layer(x)
    with torch.no_grad(), torch.enable_grad():
        reference = layer(x).detach()
    assert lean.dtype == reference.dtype == torch.bfloat16
    assert torch.allclose(lean.float(), reference.float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("target", ["lm_head", "embed_tokens"])
def test_an_adapter_outside_the_decoder_layers_is_refused(target):
    """The engine serves and trains with the head and embeddings it was built with: an
    adapter on them would silently be neither served nor trained."""
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=f"decoder layers.*{target}"):
        attach_lora(model, TrainConfig(lora_rank=4, target_modules=("q_proj", target)))


@pytest.mark.parametrize("family", FAMILIES)
def test_the_base_model_runs_its_base_layers_alone_without_peft_forward(family, monkeypatch):
    """With the adapters disabled (DPO's reference), each adapted layer runs its base layer
    as PEFT's forward would, without that forward: the same logits as the model before
    the adapter was attached."""
    from peft.tuners.lora.layer import Linear as LoraLinear
    from trainer.adapter import adapters_disabled

    engine = make_engine(family)
    ids = torch.tensor([encode("Hello there, how are you?")], device=TEST_DEVICE)
    with torch.inference_mode():
        before = engine.model(ids).logits
    peft_model = attach_lora(engine.model, TrainConfig(mode="cpt", lora_rank=4), init_lora_weights=False)
    calls = []
    original = LoraLinear.forward
    monkeypatch.setattr(LoraLinear, "forward", lambda self, *a, **k: calls.append(self) or original(self, *a, **k))
    with adapters_disabled(peft_model), torch.no_grad():
        base = peft_model(ids).logits
    assert torch.equal(base, before) and not calls
    with torch.enable_grad():
        peft_model(ids)  # adapters on, under autograd on a float32 model: PEFT's forward
    assert calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_only_a_float32_model_serves_its_adapter_merged_and_either_trains_on_its_recording(dtype, monkeypatch):
    """`W + s B A` rounded to bfloat16 would lose updates below W's precision, and PEFT's
    A and B stay float32 beside a bfloat16 W: a bfloat16 model serves its adapter unmerged
    on any CPU (on one that packs bfloat16, building the merged copies failed)."""
    from tests.conftest import make_training
    from tests.test_training import serve
    if dtype == torch.bfloat16:  # as on a CPU that packs bfloat16 weights, whichever this is
        monkeypatch.setattr("trainer.adapter.packed_linear_available", lambda device, dtype: True)
    trainer = make_training(TrainConfig(mode="cpt", lora_rank=4, lora_compute_dtype="float32"), dtype=dtype)
    layers = [m for m in trainer.peft_model.modules() if isinstance(m, LeanLoraLinear)]
    merged = dtype == torch.float32 and TEST_DEVICE.type == "cpu" and torch.backends.mkldnn.is_available()
    assert all(layer.can_merge() == merged and (layer._merged_pack is not None) == merged for layer in layers)
    serve(trainer, "a")
    trainer.train_until_idle()
    assert trainer.optimizer.version == 1 and trainer.stats.trained_entries == {("cpt", "reuse"): 1}
