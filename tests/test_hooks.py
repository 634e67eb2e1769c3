"""HookSet: every hook it adds leaves with it, newest first, also when the forward raises."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from actscan.measure.gemms import aside
from actscan.measure.hooks import HookSet, Watcher


def _hook_counts(m: nn.Module) -> tuple[int, int, int]:
    return len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks)


def test_hooks_leave_with_the_set_also_on_error() -> None:
    lin = nn.Linear(3, 3)
    seen: list[str] = []
    with pytest.raises(RuntimeError), HookSet() as hooks:
        hooks.forward(lin, lambda m, a, o: seen.append("post"))
        hooks.forward_pre(lin, lambda m, a: seen.append("pre"))
        hooks.full_backward(lin, lambda m, gi, go: None)
        lin(torch.ones(1, 3))
        assert _hook_counts(lin) == (1, 1, 1)
        raise RuntimeError("the model's own error")
    assert seen == ["pre", "post"]
    assert _hook_counts(lin) == (0, 0, 0)


def test_nested_sets_remove_only_their_own_and_tensor_hooks_go_too() -> None:
    lin = nn.Linear(2, 2)
    grads: list[torch.Tensor] = []
    with HookSet() as outer:
        outer.forward(lin, lambda m, a, o: None)
        with HookSet() as inner:
            inner.forward(lin, lambda m, a, o: None)
            x = torch.ones(1, 2, requires_grad=True)
            inner.tensor(x, grads.append)
            assert len(inner) == 2
        assert _hook_counts(lin) == (1, 0, 0)
        lin(x).sum().backward()
        assert grads == []  # the tensor hook left with the inner set
    assert _hook_counts(lin) == (0, 0, 0)
    outer.remove()  # a second removal is harmless


class _Names(TorchFunctionMode):
    """A user's mode: records the names of the calls it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.names.append(getattr(func, "__name__", ""))
        return func(*args, **(kwargs or {}))


class _WatcherNames(Watcher, _Names):
    pass


def test_watchers_do_not_see_the_hooks_computation_and_a_users_mode_still_does() -> None:
    """actscan's watchers see the model's calls, never a hook's (a hook's `x / ‖x‖` on a
    linear output must not read as the model's normalisation); a user's mode below them
    sees both, and the mode stack is the same after each hook, also when a hook raises."""
    lin = nn.Linear(4, 4)
    user, watcher = _Names(), _WatcherNames()

    def hook(_m: nn.Module, _a: object, out: torch.Tensor) -> None:
        assert torch._C._len_torch_function_stack() == 1  # the watcher is off, the user's on
        (out / out.norm(dim=-1, keepdim=True)).amax()

    def aside_part(x: torch.Tensor) -> torch.Tensor:
        with aside():
            x.detach().square().sum()
        return torch.tanh(x)

    with HookSet() as hooks:
        hooks.forward(lin, hook)
        with user, watcher:
            y = aside_part(lin(torch.ones(2, 4)))
            assert torch._C._len_torch_function_stack() == 2
    assert "linear" in watcher.names and "tanh" in watcher.names
    assert not {"div", "norm", "amax", "square", "sum"} & set(watcher.names)
    assert {"linear", "div", "amax", "square", "tanh"} <= set(user.names)
    assert y.shape == (2, 4)

    def bad(_m: nn.Module, _a: object, _out: torch.Tensor) -> None:
        raise ValueError("a hook's own error")

    with HookSet() as hooks:
        hooks.forward(lin, bad)
        with watcher, pytest.raises(ValueError):
            lin(torch.ones(1, 4))
        assert torch._C._len_torch_function_stack() == 0
