"""The one owner of hooks on the caller's model: every hook actscan puts on a module or a
tensor goes through a `HookSet`, and leaves with it.

Why one owner: a hook left behind changes the caller's model after `scan()` returns, and a
hook registered in the wrong order changes what another one sees. A `HookSet` is a scope:
hooks added inside `with HookSet() as hooks:` are removed in `finally`, in reverse order,
also when the forward raises. Nested scopes (the recorder's inside the run's) remove only
their own. Tensor hooks (`Tensor.register_hook`) live as long as their tensor's graph; they
are registered here too, so that no other module calls the registration API.

A hook's own computation is not the model's: the `TorchFunctionMode`s actscan puts around a
forward to watch the model's calls (`Watcher`s: the layout proof's adds, the usage spy's
contractions, the low-precision casts) are taken off the mode stack while a hook of this
set runs. They would otherwise see, and pay Python dispatch for, every reduction, view and
copy of the recorder's hooks — on GPT-2 124M more than half of the calls they saw — and could
read a hook's `x / ‖x‖` as the model's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

__all__ = ["HookSet", "Watcher", "unwatched", "unwatched_scope"]

_stack_len = torch._C._len_torch_function_stack
_stack_at = torch._C._get_function_stack_at
_pop = torch._C._pop_torch_function_stack
_push = torch._C._push_on_torch_function_stack


class Watcher(TorchFunctionMode):
    """A mode of actscan's own that watches the model's torch calls during a forward.
    The hooks of a `HookSet` run without it (see the module docstring); a user's own modes
    stay in place."""


def _take_watchers() -> list[TorchFunctionMode]:
    """Pops the `Watcher`s on top of the mode stack (top first); a user's mode above them
    stops the search, so it stays where it is."""
    held = []
    while _stack_len() and isinstance(_stack_at(_stack_len() - 1), Watcher):
        held.append(_pop())
    return held


def _put_back(held: list[TorchFunctionMode]) -> None:
    for mode in reversed(held):
        _push(mode)


def unwatched(hook: Callable[..., Any]) -> Callable[..., Any]:
    """`hook`, run with the `Watcher`s on top of the mode stack taken off and put back.
    A bare closure: `functools.wraps` cost 6 µs a registration, 1,000 of them a batch on a
    48-layer model's tensor hooks."""

    def run(*args: Any, **kwargs: Any) -> Any:
        if not _stack_len():  # the common case outside a watched forward: one C call
            return hook(*args, **kwargs)
        held = _take_watchers()
        try:
            return hook(*args, **kwargs)
        finally:
            _put_back(held)

    run.__wrapped__ = hook  # type: ignore[attr-defined]
    return run


@contextlib.contextmanager
def unwatched_scope() -> Iterator[None]:
    """The same for a block of code inside a forward (`gemms.aside`)."""
    held = _take_watchers() if _stack_len() else []
    try:
        yield
    finally:
        _put_back(held)


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
        return self._keep(module.register_forward_hook(unwatched(hook), with_kwargs=with_kwargs))

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
            module.register_forward_pre_hook(
                unwatched(hook), with_kwargs=with_kwargs, prepend=prepend
            )
        )

    def full_backward(self, module: nn.Module, hook: Callable[..., Any]) -> RemovableHandle:
        """`hook(module, grad_input, grad_output)`."""
        return self._keep(module.register_full_backward_hook(unwatched(hook)))

    def tensor(self, tensor: torch.Tensor, hook: Callable[[torch.Tensor], Any]) -> RemovableHandle:
        """`hook(grad)` when the gradient w.r.t. `tensor` is computed."""
        return self._keep(tensor.register_hook(unwatched(hook)))

    def remove(self) -> None:
        """Remove every hook of this set, newest first; safe to call twice."""
        handles, self._handles = self._handles, []
        for h in reversed(handles):
            h.remove()

    def _keep(self, handle: RemovableHandle) -> RemovableHandle:
        self._handles.append(handle)
        return handle
