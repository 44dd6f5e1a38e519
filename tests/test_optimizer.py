"""The adapter's AdamW: the fused kernel against torch's plain implementation — the same
updates, skips, clipping and saved state — and what it dispatches per step. On the test
device (`bench/gpu.sh cuda-tests` runs them on a GPU, where a fused step reads its step
counts on the device)."""

import io
import math

import torch

from bench.step_counts import AtenOps
from tests.tiny import TEST_DEVICE
from trainer.optimizer import AdapterOptimizer, adamw

SHAPES = [(8, 64), (64, 8), (8, 48), (96, 8)] * 5  # LoRA A and B of several layers


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator).to(TEST_DEVICE)) for shape in SHAPES]


def _gradients(step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return [(torch.randn(shape, generator=generator) * (1 + step)).to(TEST_DEVICE) for shape in SHAPES]


# (entries, updates, loss finite, a NaN in a gradient): steps as the trainer makes them
SCHEDULE = [(1, 1, True, False), (4, 1, True, False), (8, 2, True, False), (3, 1, False, False),
            (2, 1, True, True), (5, 2, True, False), (1, 1, True, False)]


def _train(optimizer: AdapterOptimizer, schedule=SCHEDULE, first: int = 0) -> list[bool]:
    applied = []
    for step, (entries, updates, finite, nan) in enumerate(schedule, start=first):
        for param, grad in zip(optimizer.params, _gradients(step)):
            param.grad = grad.clone()
        if nan:
            optimizer.params[3].grad[0, 0] = math.nan
        versions = [param._version for param in optimizer.params]
        applied.append(optimizer.step(loss_is_finite=finite, entries=entries, updates=updates))
        # an applied step is seen by every parameter's version (the serving copies, merged
        # weights and recordings key on it); a skipped one changed nothing
        moved = [param._version > version for param, version in zip(optimizer.params, versions)]
        assert all(moved) if applied[-1] else not any(moved), (step, moved)
    return applied


def _assert_same(fused: AdapterOptimizer, plain: AdapterOptimizer) -> None:
    for a, b in zip(fused.params, plain.params):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    fused_state, plain_state = fused.optimizer.state_dict()["state"], plain.optimizer.state_dict()["state"]
    for index in plain_state:
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(fused_state[index][key], plain_state[index][key], rtol=1e-6, atol=1e-9)
        assert float(fused_state[index]["step"]) == float(plain_state[index]["step"])
    assert (fused.version, fused.skipped_steps) == (plain.version, plain.skipped_steps)


def test_the_fused_adamw_updates_as_the_plain_one_with_clipping_skips_and_several_updates():
    fused = AdapterOptimizer(_params(), learning_rate=1e-2, max_grad_norm=5.0)
    plain = AdapterOptimizer(_params(), learning_rate=1e-2, max_grad_norm=5.0, fused=False)
    assert fused.optimizer.defaults["fused"] and not plain.optimizer.defaults["fused"]
    applied = _train(fused)
    assert applied == _train(plain) == [True, True, True, False, False, True, True]
    _assert_same(fused, plain)
    assert max((p - q).abs().max().item() for p, q in zip(fused.params, _params())) > 1e-3  # it trained


def test_a_saved_state_resumes_the_same_in_either_implementation():
    """A version saved by one implementation (an adapter directory written before, or on
    another machine) and read back to the CPU, loaded into the other, trains on as the
    saver would have (a fused step on a GPU reads its step counts there)."""
    for saver_fused in (False, True):
        saver = AdapterOptimizer(_params(), learning_rate=1e-2, max_grad_norm=5.0, fused=saver_fused)
        _train(saver, SCHEDULE[:3])
        saved = io.BytesIO()  # as the adapter store writes and reads it back
        torch.save(saver.state_dict(), saved)
        saved.seek(0)
        state = torch.load(saved, map_location="cpu", weights_only=True)
        weights = [p.detach().clone() for p in saver.params]
        loader = AdapterOptimizer([torch.nn.Parameter(w.clone()) for w in weights], learning_rate=1e-2,
                                  max_grad_norm=5.0, fused=not saver_fused)
        loader.load_state_dict(state, version=saver.version)
        assert loader.optimizer.param_groups[0]["fused"] is (not saver_fused or None)  # the live implementation
        _train(saver, SCHEDULE[3:], first=3)
        _train(loader, SCHEDULE[3:], first=3)
        _assert_same(*((saver, loader) if saver_fused else (loader, saver)))


def test_the_fused_step_dispatches_a_few_ops_for_every_tensor_together():
    """Each op a kernel launch on a GPU: the plain step's grow with the LoRA tensors on the
    CPU (several per tensor), the fused step's do not."""
    counts = {}
    for fused in (True, False):
        optimizer = AdapterOptimizer(_params(), learning_rate=1e-2, max_grad_norm=1e9, fused=fused)
        _train(optimizer, SCHEDULE[:1])  # AdamW's state exists
        for param, grad in zip(optimizer.params, _gradients(1)):
            param.grad = grad
        counter = AtenOps()
        with counter.counting():
            optimizer.optimizer.step()
        counts[fused] = counter.total
    assert counts[True] <= 5, counts
    if TEST_DEVICE.type == "cpu":  # torch's default there goes tensor by tensor (on a GPU it is foreach)
        assert counts[False] >= 6 * len(SHAPES), counts


def test_a_device_without_the_fused_kernel_gets_the_default_adamw():
    """Torch would refuse a fused AdamW there only at its first step."""
    assert adamw(_params(), 1e-2).defaults["fused"]
    assert not adamw([torch.nn.Parameter(torch.empty(2, 2, device="meta"))], 1e-2).defaults["fused"]
    assert not adamw(_params(), 1e-2, fused=False).defaults["fused"]
