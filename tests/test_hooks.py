"""HookSet: every hook it adds leaves with it, newest first, also when the forward raises."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from actscan.measure.hooks import HookSet


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
