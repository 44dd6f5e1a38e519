"""Weight stashing: the LoRA weights of past adapter versions that live recordings need.

A recording served under adapter version `v` holds a graph of θ_v. After an optimizer
step the live LoRA weights are θ_{v+1}, changed in place: back-propagating the old graph
as it is would mix weights (autograd's version check refuses). Instead, before each
optimizer step the weights of the version about to be replaced are copied here if a live
recording still needs them (a few MB: only the adapter), and a job on a stale recording
runs against them:
  - the recording's saved weights are resolved to the copies when backward unpacks them
    (`resolve`, the recording's `SavedTensorTracker.resolve_stale`), or when backward
    reads them from its node (the CPU's merged path, `LeanLoraLinear.weight_at`);
  - every forward the job runs itself (DPO's responses, a recomputed offloaded layer)
    runs with the copies swapped into the model (`weights_of`), slice by slice;
  - the gradient, ∇L(θ_v), lands on the live weights and the optimizer applies it to
    θ_now: a delayed gradient, as in asynchronous SGD and PipeDream's weight stashing.
With `train.stale_weights = "live"` the copies are given the live values before such a
job (`aim_at_live`), which then runs with the live weights (nothing swapped): the
recording's activations are v's, its LoRA products today's — closer to a fresh pass's
gradient than ∇L(θ_v) where the job runs forwards of its own (DPO's responses), though
not exact to first order (each layer's input is still what v's lower layers made), and,
from a fresh adapter whose B is zero at v, a gradient for A, which ∇L(θ_v) does not have.
A version's copies are freed with the last recording that needs them.
"""

from __future__ import annotations

import contextlib

import torch

from trainer.adapter import LeanLoraLinear


class WeightStash:
    def __init__(self, peft_model, parameter_keys: set[int] | None = None, training_copies=()):
        """`parameter_keys`: storages the activation offloader counts as weights, never as
        activations (offload/build.py): the copies join it while they live, since a
        prefill recorded under a stashed version saves them (trainer/lifecycle.py);
        `training_copies`: the groups' TrainingCopies (trainer/training_copy.py), if any."""
        self.parameter_keys = parameter_keys if parameter_keys is not None else set()
        self.training_copies = list(training_copies)
        # (layer, adapter name) of every adapted layer, and the live LoRA parameters
        self._layers = [(m, m.active_adapters[0]) for m in peft_model.modules() if isinstance(m, LeanLoraLinear)]
        self._live = [p for m, name in self._layers for p in (m.lora_A[name].weight, m.lora_B[name].weight)]
        for layer, _ in self._layers:  # graphs that hold the weights on their nodes resolve them here
            layer.stale_resolver = self.resolve
        # version -> copies of the live parameters (same order), as nn.Parameters
        self._versions: dict[int, list[torch.nn.Parameter]] = {}
        # (storage pointer, version counter) of a live parameter -> (its copy at that
        # counter, the live parameter's storage offset)
        self._by_counter: dict[tuple[int, int], tuple[torch.Tensor, int]] = {}
        # version -> the keys of _by_counter it added
        self._keys: dict[int, list[tuple[int, int]]] = {}

    @property
    def versions(self) -> list[int]:
        return sorted(self._versions)

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for copies in self._versions.values() for p in copies)

    def has(self, version: int) -> bool:
        return version in self._versions

    @torch.no_grad()
    def keep(self, version: int) -> None:
        """Copies the live weights as adapter `version` (call before they change)."""
        if version in self._versions:
            return
        copies, keys = [], []
        for live in self._live:
            # the same layout as the live weight, so that any view of it maps onto the copy
            copy = torch.nn.Parameter(live.detach().clone(memory_format=torch.preserve_format),
                                      requires_grad=live.requires_grad)
            copies.append(copy)
            self.parameter_keys.add(copy.untyped_storage().data_ptr())
            key = (live.untyped_storage().data_ptr(), live._version)
            self._by_counter[key] = (copy.detach(), live.storage_offset())
            keys.append(key)
        self._versions[version] = copies
        self._keys[version] = keys

    @torch.no_grad()
    def aim_at_live(self, version: int) -> None:
        """Gives `version`'s copies the live weights' values (`train.stale_weights = "live"`):
        its recordings then train with today's LoRA weights, through the copies as before.
        Written through `.data`, which leaves the copies' version counters alone: a graph
        recorded with them swapped in (under the eval gate) reads today's values too,
        rather than being refused as changed. The training copies (LoRA math in the
        model's dtype) are re-aimed the same way."""
        for live, copy in zip(self._live, self._versions[version]):
            copy.data.copy_(live)
        for copies in self.training_copies:
            copies.aim_at_sources()

    def release_except(self, needed: set[int]) -> None:
        """Frees the copies of every version no live recording needs."""
        for version in [v for v in self._versions if v not in needed]:
            for copy in self._versions.pop(version):
                self.parameter_keys.discard(copy.untyped_storage().data_ptr())
            for key in self._keys.pop(version):
                self._by_counter.pop(key, None)

    def resolve(self, tensor: torch.Tensor, counter: int) -> torch.Tensor | None:
        """The values `tensor` — a live LoRA weight, or a view of one (autograd saves
        `weight.t()`) — had at version counter `counter`: the same view of the copy."""
        found = self._by_counter.get((tensor.untyped_storage().data_ptr(), counter))
        if found is None:
            return None
        copy, base_offset = found
        offset = copy.storage_offset() + tensor.storage_offset() - base_offset
        return copy.as_strided(tensor.shape, tensor.stride(), offset)

    @contextlib.contextmanager
    def weights_of(self, version: int):
        """Swaps adapter `version`'s weights into the model (no in-place change to the live
        ones); on exit swaps the live ones back and adds the gradients the copies received
        to the live weights'."""
        copies = self._versions[version]
        pairs = list(zip(self._live, copies))
        self._swap(copies)
        try:
            yield
        finally:
            self._swap(self._live)
            _move_gradients(pairs)

    def collect_gradients(self, version: int) -> None:
        """Adds to the live weights the gradients `version`'s copies received outside
        `weights_of` (a recording that saved them, trained with the live weights)."""
        if version in self._versions:
            _move_gradients(list(zip(self._live, self._versions[version])))

    def discard_gradients(self, version: int) -> None:
        """Drops the gradients `version`'s copies received for a job that was dropped."""
        for copy in self._versions.get(version, ()):
            copy.grad = None

    def _swap(self, params: list[torch.nn.Parameter]) -> None:
        swapped = params is not self._live
        for i, (layer, name) in enumerate(self._layers):
            layer.lora_A[name].weight = params[2 * i]
            layer.lora_B[name].weight = params[2 * i + 1]
            layer.weights_swapped = swapped


def _move_gradients(pairs) -> None:
    for live, copy in pairs:
        if copy.grad is not None:
            live.grad = copy.grad if live.grad is None else live.grad + copy.grad
            copy.grad = None
