"""LoRA compute in the model's dtype under autograd: mixed precision for the adapter.

PEFT keeps the LoRA weights in float32 (the master weights, with the optimizer state).
On a bfloat16 model, its forward casts every adapted layer's input to float32, runs both
LoRA GEMMs in float32 and casts the sum back — forward and backward, in every recorded
prefill and every training forward. Instead, per group of adapted layers that read the
same input (trainer/serving_copy.py's groups: q/k/v, gate/up, o, down), a recorded or
training forward runs with a copy of the group's LoRA weights in the model's dtype as
autograd leaves, laid out as the serving copy is:

- `a`: the members' A stacked, (Σr, in);
- `b`: their s·B block-diagonal, (Σout, Σr).

`_GroupLoraFunction` computes the group's outputs (base + adapter, the members' side by
side, split among them as views). Its forward is serving's own: two GEMMs from the
serving copy (`x [W; A]ᵀ`, then `addmm` with (s·B)ᵀ), when that copy holds this copy's
values (it follows the live weights; not while the eval gate pins it, nor for a stashed
version) — so recording a prefill launches the GEMMs serving does — and three otherwise
(the members' base weights as one, x Aᵀ, · (s·B)ᵀ). Its backward forms the group's
input gradient in two GEMMs (`g W_base + (g s·B) A`) and the copy's gradients from the
input it saved, x Aᵀ formed again there as `_MergedLoraFunction` (trainer/adapter.py)
does: a graph saves only its input (and a copy re-aimed at today's weights,
`stale_weights = "live"`, gives today's LoRA products, as trainer/stash.py says). A member's
output is a view of the group's: a recording keeps a copy of V (`engine.kv_cache.own_storage`),
not the whole q|k|v.

A copy is built from the weights the layers hold at that moment (the live ones, or a
stashed version's that trainer/stash.py swapped in) and never changed: a graph recorded
under version v keeps v's copy, and the first forward after the weights change builds a
new one (a cast of the adapter's weights, once per version, not per step). The gradient
of a copy's weights is added onto the float32 weights it was built from by the group's
backward itself (one op per copy weight, `_SourceGradients`; autograd's accumulation on
the copy, and a hook to move it on, would add a Python call and a cast per weight and
backward), so the optimizer, clipping, the replicas' all-reduce and the stash find it
where PEFT's path puts it. That is mixed precision as AMP does it: float32 master weights and optimizer
state, low-precision compute.

Used where the model's dtype is not the adapter's (the GPU's bfloat16 models); a float32
model keeps PEFT's path and the CPU's merged one (trainer/adapter.py). The gradient's
difference from PEFT's float32 path is measured in tests/test_training_copy.py.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict

import torch

from engine.direct_apply import direct_apply
from engine.gated_mlp import act_and_mul_again, act_and_mul_inputs

# copies kept per group: the live weights' and those of the stashed version a job swaps in
# (a graph holds its own copy for as long as it lives)
_KEPT_COPIES = 2


def masters_key(masters: list[tuple[torch.Tensor, torch.Tensor, float]]) -> tuple:
    """The identity and version counter of each (A, B): equal keys, equal values."""
    return tuple([(id(t), t._version) for a, b, _ in masters for t in (a, b)])  # a list: no generator frames


class _Copy:
    """One group's LoRA weights in the model's dtype, for one set of source weights."""

    def __init__(self, group, sources: list[tuple[torch.Tensor, torch.Tensor, float]], key: tuple):
        self.sources = sources  # kept alive: their identities key this copy
        self.key = key
        with torch.no_grad():
            if group.held == key:  # the serving copy holds these very values, laid out the same
                a, b = group.a.clone(), group.b.clone()
            else:
                a, b = torch.zeros_like(group.a), torch.zeros_like(group.b)
                for (rows, cols), (source_a, source_b, scale) in zip(group.blocks, sources):
                    a[cols].copy_(source_a)
                    b[rows, cols].copy_(source_b * scale)
        # parameters, as the weights they copy: a recording's byte count skips them; they
        # require grad so that every forward through them is recorded, but autograd never
        # accumulates on them: the group's backward lands their gradients on the sources
        self.a, self.b = torch.nn.Parameter(a), torch.nn.Parameter(b)
        # a graph holds where the gradients land, not the copy: a copy a graph no longer needs is freed
        self.landing = _SourceGradients(group.blocks, sources, (_accumulator(self.a), _accumulator(self.b)))


def _accumulator(weight: torch.Tensor):
    """The autograd node that accumulates `weight`'s gradient (held: the same node for as long as it lives)."""
    with torch.enable_grad():  # a copy may be built under no_grad (the refresh)
        return weight.view_as(weight).grad_fn.next_functions[0][0]


class _SourceGradients:
    """A copy's gradients, cast onto the float32 weights it was built from. Their `.grad`
    are views of one float32 buffer per copy tensor — the members' A stacked, their B
    stacked — so that a backward's gradient lands in one op (two for a block-diagonal B:
    its diagonal blocks stacked first), not in a cast and an add per member. Where a source's
    `.grad` is not that view any more (the stash moved a gradient, the replicas'
    all-reduce set one), the gradient is added member by member."""

    def __init__(self, blocks: list[tuple[slice, slice]], sources: list[tuple[torch.Tensor, torch.Tensor, float]],
                 accumulators: tuple = ()):
        self.blocks, self.sources = blocks, sources
        # the copy's (a, b) accumulation nodes: a backward that would not accumulate into
        # them (`torch.autograd.grad`, `backward(inputs=...)` elsewhere) lands nothing
        self.accumulators = accumulators
        # B's diagonal blocks stack into one (Σout, r) when all are r wide
        self.stackable = len({cols.stop - cols.start for _, cols in blocks}) == 1
        # "a" / "b" -> (weak references to the sources' gradient views, and to their buffer)
        self.linked: dict[str, tuple[list, weakref.ref]] = {}
        scales = {scale for _, _, scale in sources}
        self.scale = scales.pop() if len(scales) == 1 else None

    def wanted(self, index: int) -> bool:
        """Whether the running backward accumulates into the copy's `a` (0) or `b` (1), as
        autograd would decide for a leaf (in a backward only)."""
        return torch._C._will_engine_execute_node(self.accumulators[index])

    # called from `_GroupLoraFunction.backward`, with grad mode off
    def add_a(self, grad: torch.Tensor) -> None:
        """Adds the gradient of the copy's `a` (the members' A stacked) to the sources' A."""
        self._add("a", [source for source, _, _ in self.sources], grad, [cols for _, cols in self.blocks], 1.0)

    def add_b(self, grad: torch.Tensor) -> None:
        """Adds the gradient of the copy's `b` (the members' s·B block-diagonal) to the sources' B."""
        if self.scale is not None and self.stackable:  # the diagonal blocks stacked: one op, or none for one member
            stacked = grad if len(self.blocks) == 1 else torch.cat([grad[rows, cols] for rows, cols in self.blocks])
            self._add("b", [source for _, source, _ in self.sources], stacked, [rows for rows, _ in self.blocks],
                      self.scale)
            return
        grad = grad.to(self.sources[0][1].dtype)
        for (rows, cols), (_, source, scale) in zip(self.blocks, self.sources):
            _accumulate(source, grad[rows, cols], scale)  # d(s·B) = s dB

    def _add(self, name: str, sources: list[torch.Tensor], stacked: torch.Tensor, rows: list[slice],
             scale: float) -> None:
        """Adds `scale` × `stacked` (the members' gradients, their rows `rows`) to `sources`."""
        buffer = self._linked_buffer(name, sources)
        if buffer is not None:
            buffer.add_(stacked, alpha=scale)
        elif all([source.grad is None for source in sources]):
            buffer = stacked.to(sources[0].dtype, copy=True)
            if scale != 1.0:
                buffer.mul_(scale)
            for source, r in zip(sources, rows):
                source.grad = buffer[r]
            # weak: the buffer lives as long as the sources' gradients do (zero_grad frees it)
            self.linked[name] = [weakref.ref(source.grad) for source in sources], weakref.ref(buffer)
        else:
            self.linked.pop(name, None)
            grad = stacked.to(sources[0].dtype)
            for source, r in zip(sources, rows):
                _accumulate(source, grad[r], scale)

    def _linked_buffer(self, name: str, sources: list[torch.Tensor]) -> torch.Tensor | None:
        """The buffer whose views every source's `.grad` still is, or None."""
        views, buffer = self.linked.get(name, ((), None))
        if buffer is None or any([source.grad is None or source.grad is not view()
                                  for source, view in zip(sources, views)]):
            return None
        return buffer()


def _accumulate(weight: torch.Tensor, grad: torch.Tensor, scale: float) -> None:
    if weight.grad is None:
        weight.grad = grad * scale if scale != 1.0 else grad.contiguous()
    else:
        weight.grad.add_(grad, alpha=scale)


class TrainingCopies:
    """A group's copies for autograd, by the identity and version of its source weights."""

    def __init__(self, group, parameter_keys: set[int] | None = None):
        """`parameter_keys`: storages the activation offloader counts as weights (a copy
        saved by a recorded graph is a weight, not an activation), while each copy lives."""
        self.group = group
        self.parameter_keys = parameter_keys
        self._copies: OrderedDict[tuple, _Copy] = OrderedDict()
        # every copy alive, those graphs keep included: a graph holds a copy's weights, not
        # the copy, so by the id of its `a`: (a, b) weakly, and the sources it was built from
        self._alive: dict[int, tuple[weakref.ref, weakref.ref, list]] = {}
        self._input: torch.Tensor | None = None
        self._outputs: tuple[torch.Tensor, ...] = ()
        self._served = 0
        # (the live weights' version counters, the copy of them) last returned by `current`
        self._last_live: tuple[list[int], _Copy] | None = None
        self._members = len(group.layers)

    def count_as_weights(self, parameter_keys: set[int]) -> None:
        """From now on (and for the copies alive now) the offloader counts copies as weights."""
        self.parameter_keys = parameter_keys
        for copy in self._copies.values():
            self._track(copy)

    def current(self) -> _Copy:
        group = self.group
        if group.swapped:  # a stashed version's weights in the layers
            self._last_live = None
            return self._copy_of([layer.serving_masters() for layer in group.layers])
        # the live weights: the same tensors always, so their version counters alone say
        # whether the copy last returned still holds their values (a forward asks per group)
        versions = [t._version for t in group.master_tensors]
        last = self._last_live
        if last is not None and last[0] == versions:
            return last[1]
        copy = self._copy_of(group.live_masters)
        self._last_live = (versions, copy)
        return copy

    def _copy_of(self, sources: list[tuple[torch.Tensor, torch.Tensor, float]]) -> _Copy:
        key = masters_key(sources)
        copy = self._copies.get(key)
        if copy is None:
            copy = self._copies[key] = _Copy(self.group, sources, key)
            self._alive[id(copy.a)] = (weakref.ref(copy.a), weakref.ref(copy.b), copy.sources)
            weakref.finalize(copy.a, self._alive.pop, id(copy.a), None)
            self._track(copy)
            while len(self._copies) > _KEPT_COPIES:
                self._copies.popitem(last=False)
        self._copies.move_to_end(key)
        return copy

    @torch.no_grad()
    def aim_at_sources(self) -> None:
        """Gives every copy alive its sources' values now (`train.stale_weights = "live"`,
        trainer/stash.py), through `.data`: a graph that saved a copy reads them rather
        than refusing it as changed."""
        for a_ref, b_ref, sources in list(self._alive.values()):
            a, b = a_ref(), b_ref()
            if a is None or b is None:
                continue
            for (rows, cols), (source_a, source_b, scale) in zip(self.group.blocks, sources):
                a.data[cols].copy_(source_a)
                b.data[rows, cols].copy_(source_b * scale)

    def _track(self, copy: _Copy) -> None:
        if self.parameter_keys is None:
            return
        for tensor in (copy.a, copy.b):
            key = tensor.untyped_storage().data_ptr()
            self.parameter_keys.add(key)
            weakref.finalize(tensor, self.parameter_keys.discard, key)

    def outputs(self, x: torch.Tensor, flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Every member's output (base + adapter) for the input `x` (rows `flat`), computed
        by the group's first member to ask and kept until each has read it."""
        if self._input is not x:
            copy = self.current()
            out = _group_lora(flat, copy.a, copy.b, (self.group, self.group.held == copy.key, copy.landing,
                                                     act_and_mul_inputs(x)))
            self._outputs = out.split_with_sizes(self.group.outs, dim=1)
            self._input, self._served = x, 0
        outputs = self._outputs
        self._served += 1
        if self._served == self._members:
            self._input, self._outputs = None, ()
        return outputs


class _GroupLoraFunction(torch.autograd.Function):
    """A group's outputs side by side, (N, Σout), with the gradient to the input `flat`
    returned, and those of the copy's `a` and `b` added onto the weights the copy was
    built from (`landing`; module docstring). Saves `flat` (or the gate and up it is the
    product of: engine/gated_mlp.py); the weights — the copy, never
    changed in place, and the frozen base weight — are held on the node with their
    version counters, which backward checks as autograd would, so that a recorded
    prefill's saved-tensor hooks (engine/recording.py) run for its activations only."""

    @staticmethod
    def forward(ctx, flat: torch.Tensor, a: torch.Tensor, b: torch.Tensor, call: tuple):
        # (the group, whether the serving copy holds this copy's values, where the gradients
        # land, the gate, up and activation that `flat` is the product of, or None)
        group, from_serving, landing, factors = call
        # the down projection's input is act(gate) * up: its factors are saved already (engine/gated_mlp.py)
        ctx.save_for_backward(*(factors[:2] if factors is not None else (flat,)))
        ctx.flat_again = factors[2] if factors is not None else None  # the activation, or None: flat is saved
        ctx.landing = landing
        base_weight = group.base_weight
        ctx.weights, ctx.versions = (a, b, base_weight), (a._version, b._version, base_weight._version)
        if from_serving:
            return group.fused_output(flat)
        base = (torch.addmm(group.bias, flat, group.base_weight.t()) if group.bias is not None
                else flat @ group.base_weight.t())
        return torch.addmm(base, flat @ a.t(), b.t())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        a, b, base_weight = ctx.weights
        if (a._version, b._version, base_weight._version) != ctx.versions:
            raise RuntimeError("a LoRA copy or a frozen weight was modified in place between forward and backward")
        grad_rank = grad @ b  # (N, Σr)
        grad_x = torch.addmm(grad @ base_weight, grad_rank, a) if ctx.needs_input_grad[0] else None
        if torch.is_grad_enabled():  # a backward with create_graph: the landing records no graph
            with torch.no_grad():
                _land(ctx, grad, grad_rank, a)
        else:
            _land(ctx, grad, grad_rank, a)
        return grad_x, None, None, None


_group_lora = direct_apply(_GroupLoraFunction)


def _land(ctx, grad: torch.Tensor, grad_rank: torch.Tensor, a: torch.Tensor) -> None:
    """`_GroupLoraFunction.backward`'s gradients of the copy's `a` and `b`, onto its sources
    (the saved input, or the product formed again, is read only for them)."""
    landing = ctx.landing
    want_a, want_b = ctx.needs_input_grad[1] and landing.wanted(0), ctx.needs_input_grad[2] and landing.wanted(1)
    if not (want_a or want_b):
        return
    saved = ctx.saved_tensors
    flat = act_and_mul_again(*saved, ctx.flat_again).flatten(0, -2) if ctx.flat_again else saved[0]
    if want_a:
        landing.add_a(grad_rank.t() @ flat)
    if want_b:
        landing.add_b(grad.t() @ (flat @ a.t()))


def train_from_copy(layer, x: torch.Tensor) -> torch.Tensor | None:
    """`layer`'s output (base + adapter) under autograd, the LoRA part in the model's dtype;
    None where `layer` does not take this path: it is in no group, the model's dtype is the
    master weights', or its adapter is not a single plain one (adapters off: the caller's)."""
    group = layer.serving_group
    if group is None or group.training is None or x.dtype == group.master_dtype or not layer.plain_adapter():
        return None
    flat = x.reshape(-1, x.shape[-1])
    out = group.training.outputs(x, flat)[layer.serving_index]
    return out.view(*x.shape[:-1], out.shape[-1])
