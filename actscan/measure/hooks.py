"""The one owner of hooks on the caller's model: every hook actscan puts on a module or a
tensor goes through a `HookSet`, and leaves with it.

Why one owner: a hook left behind changes the caller's model after `scan()` returns, and a
hook registered in the wrong order changes what another one sees. A `HookSet` is a scope:
hooks added inside `with HookSet() as hooks:` are removed in `finally`, in reverse order,
also when the forward raises. Nested scopes (the recorder's inside the run's) remove only
their own. Tensor hooks (`Tensor.register_hook`) live as long as their tensor's graph; they
are registered here too, so that no other module calls the registration API.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["HookSet"]


class HookSet:
    """Hooks added through this object; `remove()` (or leaving the `with`) removes them all.

    Usable as a context manager or held by an object with its own `__enter__/__exit__`
    (the recorder), which calls `remove()` in its `finally`.
    """

    def __init__(self) -> None:
        self._handles: list[RemovableHandle] = []

    def __enter__(self) -> HookSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __len__(self) -> int:
        return len(self._handles)

    def forward(
        self, module: nn.Module, hook: Callable[..., Any], *, with_kwargs: bool = False
    ) -> RemovableHandle:
        """`hook(module, args, output)` (with kwargs: `(module, args, kwargs, output)`)."""
        return self._keep(module.register_forward_hook(hook, with_kwargs=with_kwargs))

    def forward_pre(
        self,
        module: nn.Module,
        hook: Callable[..., Any],
        *,
        with_kwargs: bool = False,
        prepend: bool = False,
    ) -> RemovableHandle:
        """`hook(module, args)` (with kwargs: `(module, args, kwargs)`)."""
        return self._keep(
            module.register_forward_pre_hook(hook, with_kwargs=with_kwargs, prepend=prepend)
        )

    def full_backward(self, module: nn.Module, hook: Callable[..., Any]) -> RemovableHandle:
        """`hook(module, grad_input, grad_output)`."""
        return self._keep(module.register_full_backward_hook(hook))

    def tensor(self, tensor: torch.Tensor, hook: Callable[[torch.Tensor], Any]) -> RemovableHandle:
        """`hook(grad)` when the gradient w.r.t. `tensor` is computed."""
        return self._keep(tensor.register_hook(hook))

    def remove(self) -> None:
        """Remove every hook of this set, newest first; safe to call twice."""
        handles, self._handles = self._handles, []
        for h in reversed(handles):
            h.remove()

    def _keep(self, handle: RemovableHandle) -> RemovableHandle:
        self._handles.append(handle)
        return handle
