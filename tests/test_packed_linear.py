"""The oneDNN prepacked linear equals F.linear, steps aside for autograd, and repacks
when its weight changes."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.packed_linear import PackedLinear, install_packed_linear, packed_linear_available

pytestmark = pytest.mark.skipif(not packed_linear_available(torch.device("cpu")), reason="needs oneDNN")


def make(bias=True):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96, bias=bias))
    assert install_packed_linear(model) == 1
    return model[0]


@pytest.mark.parametrize("rows", [1, 8, 100])
def test_inference_matches_f_linear(rows):
    layer = make()
    x = torch.randn(1, rows, 64)
    with torch.inference_mode():
        assert torch.allclose(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-5)
    assert layer._packed is not None


def test_autograd_path_gives_gradients_to_input_and_weight():
    layer = make(bias=False)
    x = torch.randn(4, 64, requires_grad=True)
    layer(x).sum().backward()
    expected = layer.weight.sum(0).expand(4, 64)
    assert torch.allclose(x.grad, expected, atol=1e-5)
    assert layer.weight.grad is not None


def test_repacks_after_an_in_place_weight_update():
    layer = make()
    x = torch.randn(3, 64)
    with torch.inference_mode():
        layer(x)
    with torch.no_grad():
        layer.weight.mul_(2)
    with torch.inference_mode():
        assert torch.allclose(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-5)


def test_is_still_an_nn_linear_with_the_same_state_dict():
    layer = make()
    assert isinstance(layer, nn.Linear) and type(layer) is PackedLinear
    assert set(layer.state_dict()) == {"weight", "bias"}


def test_frozen_weight_backward_to_input_matches_f_linear():
    layer = make()
    layer.weight.requires_grad_(False)
    layer.bias.requires_grad_(False)
    x = torch.randn(2, 5, 64, requires_grad=True)
    g = torch.randn(2, 5, 96)
    (layer(x) * g).sum().backward()
    packed_grad = x.grad.clone()
    x.grad = None
    (F.linear(x, layer.weight, layer.bias) * g).sum().backward()
    assert torch.allclose(packed_grad, x.grad, atol=1e-5)


def test_backward_after_the_frozen_weight_changed_raises():
    layer = make()
    layer.requires_grad_(False)
    x = torch.randn(3, 64, requires_grad=True)
    out = layer(x)
    with torch.no_grad():
        layer.weight.add_(1.0)
    with pytest.raises(RuntimeError, match="modified in place"):
        out.sum().backward()


@pytest.mark.skipif(torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="this CPU packs bfloat16 weights")
def test_a_bfloat16_model_is_left_unpacked_where_onednn_cannot_pack_it():
    model = nn.Sequential(nn.Linear(64, 96)).to(torch.bfloat16)
    assert install_packed_linear(model) == 0
    x = torch.randn(1, 3, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert model(x).dtype == torch.bfloat16
