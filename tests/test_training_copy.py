"""LoRA math in the model's dtype under autograd (trainer/training_copy.py): on a bfloat16
model the gradient lands on PEFT's float32 weights and is as close to the float32 model's
as PEFT's own path gets; a graph keeps the weights it was recorded under; the offloader
counts the copies as weights; and a training forward and backward costs fewer ops and casts."""

import pytest
import torch

from bench.step_counts import AtenOps
from tests.conftest import make_training
from tests.test_training import relative_difference, serve
from tests.tiny import TEST_DEVICE, tiny_model
from trainer.adapter import LeanLoraLinear, attach_lora, lora_gradients, lora_parameters
from trainer.config import TrainConfig
from trainer.serving_copy import build_serving_copies


def adapted(family: str, dtype: torch.dtype, train_in_model_dtype: bool):
    model = tiny_model(family, dtype=dtype)
    peft_model = attach_lora(model, TrainConfig(mode="cpt", lora_rank=4), init_lora_weights=False)
    groups = build_serving_copies(model.model.layers, lambda m: isinstance(m, LeanLoraLinear), dtype,
                                  train_in_model_dtype)
    return model, peft_model, groups


def gradients_on(model, peft_model, ids: torch.Tensor) -> dict:
    for p in lora_parameters(peft_model):
        p.grad = None
    logits = model(ids).logits.float()
    torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]).backward()
    return lora_gradients(peft_model)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma3_text", "phi3"])
def test_bfloat16_gradient_lands_on_the_float32_weights_as_close_to_the_truth_as_peft(family):
    ids = torch.randint(3, 200, (1, 24), generator=torch.Generator().manual_seed(0)).to(TEST_DEVICE)
    truth = gradients_on(*adapted(family, torch.float32, True)[:2], ids)  # float32 model: PEFT's path
    model, peft_model, groups = adapted(family, torch.bfloat16, True)
    mixed = gradients_on(model, peft_model, ids)
    assert all(g.dtype == torch.float32 for g in mixed.values()) and set(mixed) == set(truth)
    assert all(group.training.current().a.grad is None for group in groups)  # landed on the masters
    peft = gradients_on(*adapted(family, torch.bfloat16, False)[:2], ids)
    mixed_error, peft_error = relative_difference(mixed, truth), relative_difference(peft, truth)
    assert mixed_error <= 1.5 * peft_error + 2e-2, (mixed_error, peft_error)


def test_a_graph_keeps_the_weights_it_was_recorded_under():
    """An optimizer step between forward and backward changes the float32 weights in place:
    the graph's copy is not touched (no version error), and it yields the gradient at the
    weights of its forward; the next forward builds a copy of the new weights."""
    ids = torch.randint(3, 200, (1, 16), generator=torch.Generator().manual_seed(1)).to(TEST_DEVICE)
    model, peft_model, groups = adapted("llama", torch.bfloat16, True)
    before = gradients_on(model, peft_model, ids)
    logits = model(ids).logits.float()
    first = groups[0].training.current()
    with torch.no_grad():
        for p in lora_parameters(peft_model):
            p.add_(0.5)
    for p in lora_parameters(peft_model):
        p.grad = None
    torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]).backward()
    assert relative_difference(lora_gradients(peft_model), before) == 0.0
    assert groups[0].training.current() is not first
    assert gradients_on(model, peft_model, ids).keys() == before.keys()


@pytest.mark.parametrize("changed", ["copy", "base weight"])
def test_a_weight_the_graph_holds_changed_in_place_refuses_the_backward(changed):
    """The weights are held on the graph's nodes, not saved through autograd (so that a
    recorded prefill's saved-tensor hooks see activations only): their version check is
    the node's own, and a backward after an in-place change raises as autograd would."""
    ids = torch.randint(3, 200, (1, 12), generator=torch.Generator().manual_seed(3)).to(TEST_DEVICE)
    model, _, groups = adapted("llama", torch.bfloat16, True)
    logits = model(ids).logits.float()
    copy = groups[0].training.current()
    with torch.no_grad():
        (copy.a if changed == "copy" else groups[0].base_weight).mul_(1.0)
    with pytest.raises(RuntimeError, match="modified (in place|by an inplace operation)"):
        torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]).backward()


def test_the_recorded_prefill_hooks_see_the_activations_not_the_weights():
    from engine.recording import SavedTensorTracker
    ids = torch.randint(3, 200, (1, 12), generator=torch.Generator().manual_seed(4)).to(TEST_DEVICE)
    model, _, groups = adapted("llama", torch.bfloat16, True)
    seen = []
    tracker = SavedTensorTracker()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or tracker.hooks().pack_hook(t),
                                                  lambda saved: saved.unpack()):
        model(ids)
    weights = {id(w) for group in groups for w in (group.training.current().a, group.training.current().b,
                                                   group.base_weight)}
    assert seen and not any(id(t) in weights for t in seen)


def test_a_recorded_prefill_counts_the_copies_as_weights_and_trains_on_the_stash():
    """A bfloat16 server: the recorded prefill saves the group copies (weights for the
    offloader), and a stale recording trains against its version's weights."""
    from offload.config import OffloadConfig
    torch.manual_seed(0)
    offload = OffloadConfig(device_budget_bytes=1 << 30)
    trainer = make_training(TrainConfig(mode="cpt", lora_rank=4, max_staleness=2, entries_per_step=1,
                                        cohort_max_entries=1), offload=offload, init_lora_weights=False,
                            dtype=torch.bfloat16)
    groups = trainer.maintenance.serving_copies
    serve(trainer, "a")
    copy = groups[0].training.current()
    assert copy.a.untyped_storage().data_ptr() in trainer.offloader.param_keys
    serve(trainer, "b", prompt="Another prompt, served under the same version.")
    trainer.train_until_idle()
    assert trainer.optimizer.version == 2
    assert trainer.stats.trained_entries.get(("cpt", "stashed"), 0) == 1  # "b" trained on its own recording


def test_a_training_forward_in_the_models_dtype_runs_fewer_ops_and_no_casts():
    ids = torch.randint(3, 200, (1, 16), generator=torch.Generator().manual_seed(2)).to(TEST_DEVICE)
    counts = {}
    for mixed in (True, False):
        model, peft_model, _ = adapted("llama", torch.bfloat16, mixed)
        gradients_on(model, peft_model, ids)  # the copies are built once per version, not per forward
        counter = AtenOps()
        with counter.counting():
            gradients_on(model, peft_model, ids)
        counts[mixed] = counter
    assert counts[True].total < 0.8 * counts[False].total, (counts[True].total, counts[False].total)
    # PEFT casts each adapted layer's input to float32 and its output back; the copies cast
    # once per group copy in backward, the gradient onto the masters. The model's own
    # casts (RMSNorm's, the loss's) are in both counts.
    adapted_layers = sum(isinstance(m, LeanLoraLinear) for m in model.modules())
    assert counts[False].ops["_to_copy"] - counts[True].ops["_to_copy"] >= 2 * adapted_layers


def test_copies_no_graph_or_version_needs_are_freed():
    """A copy lives while a graph or the group's small cache holds it (its hooks hold the
    float32 weights, not the copy): one per adapter version would leak on a long run."""
    import gc
    import weakref
    ids = torch.randint(3, 200, (1, 8), generator=torch.Generator().manual_seed(3)).to(TEST_DEVICE)
    model, peft_model, groups = adapted("llama", torch.bfloat16, True)
    gradients_on(model, peft_model, ids)
    first = weakref.ref(groups[0].training.current().a)
    for _ in range(3):  # three more versions, each trained once
        with torch.no_grad():
            for p in lora_parameters(peft_model):
                p.add_(0.01)
        gradients_on(model, peft_model, ids)
    gc.collect()
    assert first() is None


def test_a_recording_counts_activations_not_the_weights_its_gemms_save():
    """A linear layer's GEMM (`addmm`, and `F.linear`, which is one) saves a view of the
    frozen weight, `weight.t()`: the recording's bytes are its activations all the same
    (counting every weight once per recording filled the activation cache on a bfloat16
    model after a few prompts)."""
    from engine.recording import SavedTensorTracker
    weight = torch.nn.Parameter(torch.randn(256, 64), requires_grad=False)
    x = torch.randn(3, 64, requires_grad=True)
    tracker = SavedTensorTracker()
    with tracker.hooks():
        out = torch.nn.functional.linear(x, weight) + torch.addmm(torch.zeros(256), x, weight.t())
    assert out.requires_grad and tracker.live_bytes == 0  # the input's gradient needs the weight only


def test_a_recording_does_not_count_the_copies_as_its_activations():
    """The copies are weights shared by every recording of a version (parameters, as the
    weights they copy), not bytes of each recording."""
    from engine.recording import SavedTensorTracker
    model, _, groups = adapted("llama", torch.bfloat16, True)
    ids = torch.randint(3, 200, (1, 8), generator=torch.Generator().manual_seed(4)).to(TEST_DEVICE)
    tracker = SavedTensorTracker()
    with tracker.hooks():
        logits = model(ids).logits
    copies = {t.untyped_storage().data_ptr() for g in groups for t in (g.training.current().a, g.training.current().b)}
    assert logits.requires_grad and tracker.live_bytes > 0 and not copies & set(tracker._storages)


def _gemms(counter: AtenOps) -> int:
    return counter.ops["mm"] + counter.ops["addmm"]


def test_a_forward_under_autograd_runs_servings_gemms_while_the_serving_copy_holds_its_weights():
    """Recording a prefill launches the GEMMs serving does (two per group); when the
    serving copy holds other values (after an optimizer step, before its refresh) a group
    takes three, and the gradients agree."""
    ids = torch.randint(3, 200, (1, 16), generator=torch.Generator().manual_seed(5)).to(TEST_DEVICE)
    model, peft_model, groups = adapted("llama", torch.bfloat16, True)
    counts = {}
    for name, grad in (("serving", False), ("recorded", True)):
        counts[name] = AtenOps()
        with torch.set_grad_enabled(grad), counts[name].counting():
            model(ids)
    assert _gemms(counts["recorded"]) == _gemms(counts["serving"])
    fused = gradients_on(model, peft_model, ids)
    with torch.no_grad():
        for p in lora_parameters(peft_model):
            p.mul_(1.0)  # the same values under a new version: the serving copy no longer vouches for them
    counter = AtenOps()
    with counter.counting():
        model(ids)
    assert _gemms(counter) == _gemms(counts["serving"]) + len(groups)
    assert relative_difference(gradients_on(model, peft_model, ids), fused) < 2e-2


def test_the_gradient_lands_in_one_op_per_copy_weight_and_equals_adding_it_member_by_member():
    """The float32 weights' gradients are views of one buffer per copy weight: a backward
    adds to it in one op (B's diagonal blocks stacked first). The same sums as adding each member's
    slice, as happens once someone else set a gradient (here: zeros set beforehand)."""
    ids = torch.randint(3, 200, (1, 16), generator=torch.Generator().manual_seed(6)).to(TEST_DEVICE)
    model, peft_model, groups = adapted("llama", torch.bfloat16, True)
    params = lora_parameters(peft_model)
    sums = {}
    for preset in (None, "zeros"):
        for p in params:
            p.grad = None if preset is None else torch.zeros_like(p)
        for _ in range(2):  # a second backward adds to the first's
            torch.nn.functional.cross_entropy(model(ids).logits.float()[0, :-1], ids[0, 1:]).backward()
        sums[preset] = lora_gradients(peft_model)
    assert all(torch.equal(sums[None][k], sums["zeros"][k]) for k in sums["zeros"])
    for p in params:
        p.grad = None
    logits = model(ids).logits.float()
    torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]).backward()  # links the views
    logits = model(ids).logits.float()
    loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])
    counter = AtenOps()
    with counter.counting():
        loss.backward()
    assert counter.ops["add_"] == 8 * len(model.model.layers)  # per layer and group, one for A and one for B
    assert counter.ops["index"] + counter.ops["index_select"] == 0  # B's blocks: views stacked, no index tensor


def test_the_groups_backward_lands_the_gradient_without_autograds_accumulation_or_a_hook():
    """The group's backward adds its copy's gradients onto the masters itself: autograd
    accumulates nothing on the copy, and no Python hook runs per copy weight and backward."""
    ids = torch.randint(3, 200, (1, 16), generator=torch.Generator().manual_seed(7)).to(TEST_DEVICE)
    model, peft_model, groups = adapted("llama", torch.bfloat16, True)
    gradients = gradients_on(model, peft_model, ids)
    assert all(g is not None and g.abs().sum() > 0 for g in gradients.values())
    for group in groups:
        copy = group.training.current()
        assert copy.a.grad is None and copy.b.grad is None
        assert not copy.a._post_accumulate_grad_hooks and not copy.b._post_accumulate_grad_hooks


def test_a_backward_that_does_not_accumulate_into_the_adapter_lands_nothing_and_no_graph():
    """`torch.autograd.grad` to another input leaves the masters' gradients alone, as
    autograd leaves a leaf's; `create_graph` leaves none of its graph in them."""
    ids = torch.randint(3, 200, (1, 16), generator=torch.Generator().manual_seed(8)).to(TEST_DEVICE)
    model, peft_model, _ = adapted("llama", torch.bfloat16, True)
    params = lora_parameters(peft_model)
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
    (grad,) = torch.autograd.grad(model(inputs_embeds=embeds).logits.float().sum(), embeds)
    assert grad.abs().sum() > 0 and all(p.grad is None for p in params)
    model(ids).logits.float().sum().backward(create_graph=True)
    assert all(p.grad is not None and not p.grad.requires_grad for p in params)


def test_an_optimizer_steps_refresh_builds_the_training_copy_from_the_serving_copy():
    """After the adapter changes, the refresh that serving follows makes the training copy
    too, as two clones of the serving copy: the next recorded forward builds nothing, and
    the copy equals one built member by member."""
    from trainer.serving_copy import refresh_serving_copies
    ids = torch.randint(3, 200, (1, 12), generator=torch.Generator().manual_seed(7)).to(TEST_DEVICE)
    model, peft_model, groups = adapted("llama", torch.bfloat16, True)
    gradients_on(model, peft_model, ids)
    with torch.no_grad():
        for p in lora_parameters(peft_model):
            p.add_(torch.randn_like(p) * 0.01)
    refresh = AtenOps()
    with refresh.counting():
        refresh_serving_copies(groups)
    assert refresh.ops["clone"] == 2 * len(groups) and refresh.ops["zeros_like"] + refresh.ops["zeros"] == 0
    counts = []
    for _ in range(2):
        counter = AtenOps()
        with counter.counting():
            model(ids)
        counts.append(counter.total)
    assert counts[0] == counts[1]
    for group in groups:
        copy = group.training.current()
        assert copy.key == group.held
        for (rows, cols), (a, b, scale) in zip(group.blocks, copy.sources):
            assert torch.equal(copy.a[cols], a.to(copy.a.dtype)) and torch.equal(copy.b[rows, cols],
                                                                               (b * scale).to(copy.b.dtype))
        assert torch.count_nonzero(copy.b).item() == sum(torch.count_nonzero(b).item() for _, b, _ in copy.sources)


def test_a_recording_keeps_v_not_the_whole_fused_qkv_output():
    """V is a slice of its group's output: the recording keeps a copy of its own (with the
    slice, the q|k|v output of every layer would stay alive with the recording)."""
    torch.manual_seed(0)
    trainer = make_training(TrainConfig(mode="cpt", lora_rank=4), dtype=torch.bfloat16, init_lora_weights=False)
    serve(trainer, "a")
    for segment in trainer.cache.get("a").recording.segments:
        for tensor in (segment.key, segment.value):
            assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()


def test_a_copy_a_graph_still_holds_is_re_aimed_after_it_left_the_kept_copies():
    """A graph holds its copy's weights, not the copy: two weight changes later the copy
    has left the kept ones, and `aim_at_sources` (stale_weights = "live") must still give
    those weights the live values."""
    import gc
    from trainer.serving_copy import refresh_serving_copies
    ids = torch.randint(3, 200, (1, 12), generator=torch.Generator().manual_seed(8)).to(TEST_DEVICE)
    model, peft_model, groups = adapted("llama", torch.bfloat16, True)
    logits = model(ids).logits.float()  # a graph of version 0
    held_a = groups[0].training.current().a
    for _ in range(2):
        with torch.no_grad():
            for p in lora_parameters(peft_model):
                p.add_(torch.randn_like(p) * 0.05)
        refresh_serving_copies(groups)
    gc.collect()
    assert groups[0].training.current().a is not held_a
    groups[0].training.aim_at_sources()
    for (rows, cols), (a, _, _) in zip(groups[0].blocks, groups[0].live_masters):
        assert torch.equal(held_a[cols], a.to(held_a.dtype))
    torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]).backward()  # the graph reads them


def test_a_stashed_version_swapped_into_the_layers_gets_a_copy_of_its_own():
    """While the weight stash has another version's weights in the layers (weights_swapped),
    the copy is built from what the layers hold; swapped back, the live copy serves again."""
    model, peft_model, groups = adapted("llama", torch.bfloat16, True)
    group = groups[0]
    live = group.training.current()
    layers = group.layers
    swapped = [(torch.nn.Parameter(layer.lora_A[layer.active_adapters[0]].weight.detach() + 0.5),
                torch.nn.Parameter(layer.lora_B[layer.active_adapters[0]].weight.detach() + 0.5)) for layer in layers]
    originals = [(layer.lora_A[layer.active_adapters[0]].weight, layer.lora_B[layer.active_adapters[0]].weight)
                 for layer in layers]
    for layer, (a, b) in zip(layers, swapped):
        layer.lora_A[layer.active_adapters[0]].weight, layer.lora_B[layer.active_adapters[0]].weight = a, b
        layer.weights_swapped = True
    stashed = group.training.current()
    assert stashed is not live
    for (rows, cols), (a, _) in zip(group.blocks, swapped):
        assert torch.equal(stashed.a[cols], a.detach().to(stashed.a.dtype))
    for layer, (a, b) in zip(layers, originals):
        layer.lora_A[layer.active_adapters[0]].weight, layer.lora_B[layer.active_adapters[0]].weight = a, b
        layer.weights_swapped = False
    assert group.training.current() is live


@pytest.mark.parametrize("member", [0, 2])
@pytest.mark.parametrize("weight", ["a", "b"])
def test_the_live_copy_is_found_by_the_weights_versions_and_built_again_when_one_changes(member, weight):
    """Asked again with the live weights unchanged, the group gives the copy it gave;
    after any member's A or B changed in place (an optimizer step, before its refresh),
    a new copy of the values now — and the one before stays as it was, for the graphs
    recorded under it."""
    _, _, groups = adapted("llama", torch.bfloat16, True)
    group = next(g for g in groups if len(g.layers) == 3)  # q, k, v
    before = group.training.current()
    held = before.a.detach().clone(), before.b.detach().clone()
    assert group.training.current() is before
    a, b, scale = group.live_masters[member]
    with torch.no_grad():
        (a if weight == "a" else b).add_(0.25)
    after = group.training.current()
    assert after is not before and group.training.current() is after
    rows, cols = group.blocks[member]
    assert torch.equal(after.a[cols], a.detach().to(after.a.dtype))
    assert torch.equal(after.b[rows, cols], (b.detach() * scale).to(after.b.dtype))
    assert torch.equal(before.a, held[0]) and torch.equal(before.b, held[1])
