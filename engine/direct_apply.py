"""`autograd.Function.apply` without its Python wrapper, for the Functions that a recorded
prefill and a training forward call once per adapted layer or decoder layer.

`Function.apply` is a Python classmethod. Before it reaches autograd's C++ apply, it
binds default arguments (for a Function that defines `setup_context`) and unwraps
functorch's dead wrappers, walking every argument in a generator: a dozen Python calls
per apply, more than the rest of an adapted layer's recorded forward. The project's
Functions define `forward(ctx, ...)` without `setup_context`, and they run outside
functorch's transforms, where that wrapper changes nothing. `direct_apply(Function)`
returns the C++ apply bound to the Function, and falls back to the wrapper while a
functorch transform is active (as the wrapper itself would then take another route).
The graph, the saved tensors and the gradients are the same either way
(tests/test_direct_apply.py).
"""

from __future__ import annotations

from typing import Callable

import torch


def direct_apply(function: type[torch.autograd.Function]) -> Callable[..., torch.Tensor]:
    """`function.apply` for positional arguments, through autograd's C++ apply directly."""
    assert function.setup_context == torch.autograd.Function.setup_context, \
        "a Function with setup_context has its default arguments bound by the wrapper"
    native = super(torch.autograd.Function, function).apply  # torch._C._FunctionBase.apply, bound
    wrapped = function.apply
    transforms_active = torch._C._are_functorch_transforms_active

    def apply(*args):
        return wrapped(*args) if transforms_active() else native(*args)

    apply.__doc__ = f"{function.__name__}.apply without its Python wrapper (engine/direct_apply.py)"
    return apply
