"""The caller's model state: kept before a run, set for the run, given back bit for bit.

A scan measures the model its caller hands over and must leave it exactly as it came,
also when the model, its loss or an optimizer step raises. This module is the one place
that knows what "as it came" covers:

* every module's attributes: train/eval mode, dropout rates, and whatever the forward
  leaves behind as a plain attribute (a cached tensor, a Python counter): each attribute
  holds the same object again, and one the run added is removed;
* every buffer, not only BatchNorm's running statistics: spectral norm's u/v, EMA copies,
  step counters, caches. The same tensor objects with the same values;
* parameters: their storage (a cast to the run's dtype/device swaps `param.data`, and the
  original comes back), `.grad` (the same tensor objects, never written) and
  `requires_grad`; their values are copied only when the run writes them (optimizer
  steps), and that copy doubles as W_0 of the first update ratio (`CallerWeights`);
* the dropout rates a transformers config holds;
* the torch CPU random stream and, once CUDA is initialised, every CUDA device's.

The run itself is in train mode, as training runs (BatchNorm normalises with the batch's
statistics), with dropout off unless asked for, so runs are reproducible.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["CallerWeights", "caller_state", "eval_mode", "kept_state"]

_DROP_ATTR = re.compile(r"drop", re.I)  # attention_dropout, attn_pdrop, layerdrop, drop_path_rate…
_MISSING = object()


class CallerWeights:
    """The copy of the caller's parameter values that `caller_state` keeps for the
    restore. The steps read it as W_0 for the first update ratio instead of taking a
    second copy of their own (they never write it)."""

    def __init__(self, params: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
        # (value, data pointer, version) per parameter: the copy stands for W_0 only while
        # the parameter still holds the same storage, unwritten since the copy
        self._kept = {
            id(p): (v, p.data_ptr(), p._version) for p, v in zip(params, values, strict=True)
        }

    def of(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
        """The kept values of `params`, bit-identical to their current values; None when
        one was replaced (cast to the run's dtype or device) or written in place since."""
        out = []
        for p in params:
            kept = self._kept.get(id(p))
            if kept is None or kept[1] != p.data_ptr() or kept[2] != p._version:
                return None
            out.append(kept[0])
        return out


def _rng_state() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple[torch.Tensor, list[torch.Tensor] | None]) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


def _restore_attributes(saved: list[tuple[nn.Module, dict[str, Any]]]) -> None:
    """Each module's `__dict__` back to the objects it held (its mode included)."""
    for m, attrs in saved:
        now = vars(m)
        for key in [k for k in now if k not in attrs]:
            del now[key]
        for key, value in attrs.items():
            if now.get(key, _MISSING) is not value:
                now[key] = value


@contextlib.contextmanager
def caller_state(model: nn.Module, *, weights: bool = True) -> Iterator[CallerWeights | None]:
    """Give the model back exactly as it came (the module doc says what that covers), also
    when the body raises. With `weights`, the parameter values are copied too and `.grad`
    is cleared for the run (the steps start from `.grad = None`); yields that copy
    (`CallerWeights`), else None."""
    modules = list(model.modules())
    params = list(model.parameters())
    attrs = [(m, dict(vars(m))) for m in modules]
    buffers = [(m, dict(m._buffers)) for m in modules]
    unique = {id(b): b for _, bufs in buffers for b in bufs.values() if b is not None}
    with torch.no_grad():
        buf_values = [(b, b.detach().clone()) for b in unique.values()]
        values = [p.detach().clone() for p in params] if weights else []
    datas = [p.data for p in params]
    grads = [p.grad for p in params]
    flags = [p.requires_grad for p in params]
    rng = _rng_state()
    try:
        if weights:
            for p in params:
                p.grad = None
        yield CallerWeights(params, values) if weights else None
    finally:
        for p, data in zip(params, datas, strict=True):
            p.data = data
        for m, bufs in buffers:
            m._buffers.clear()
            m._buffers.update(bufs)
        _restore_attributes(attrs)
        with torch.no_grad():
            for b, v in buf_values:
                b.copy_(v)
            if weights:
                for p, v in zip(params, values, strict=True):
                    p.copy_(v)
        for p, g, f in zip(params, grads, flags, strict=True):
            p.grad = g
            p.requires_grad_(f)
        _set_rng_state(rng)


def _rates(obj: Any) -> list[tuple[Any, str, float]]:
    """(owner, name, value) of the positive float dropout rates an object holds as plain
    attributes (HF attention modules pass them to sdpa/F.dropout when `training`)."""
    items = vars(obj).items() if hasattr(obj, "__dict__") else ()
    return [(obj, k, v) for k, v in items if _DROP_ATTR.search(k) and type(v) is float and v > 0]


@contextlib.contextmanager
def _no_dropout(model: nn.Module) -> Iterator[None]:
    """nn.Dropout* modules as the identity and every dropout rate at 0 (modules' and the
    config's), restored on exit."""
    rates: list[tuple[Any, str, float]] = []
    for m in model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            m.eval()  # identity
            rates.append((m, "p", m.p))
        else:
            rates += _rates(m)
    config = getattr(model, "config", None)
    if config is not None:
        rates += _rates(config)
    try:
        for owner, name, _ in rates:
            setattr(owner, name, 0.0)
        yield
    finally:
        for owner, name, value in rates:
            setattr(owner, name, value)


def _cast(model: nn.Module, device: torch.device, dtype: torch.dtype | None) -> None:
    """Parameters and buffers on `device`, floating ones in `dtype` (None: their own); the
    originals stay untouched (`param.data` and the buffer entries are swapped)."""
    for p in model.parameters():
        want = dtype if (dtype is not None and p.is_floating_point()) else p.dtype
        if p.device != device or p.dtype != want:
            p.data = p.data.to(device=device, dtype=want)
    for m in model.modules():
        for k, b in m._buffers.items():
            if b is None:
                continue
            want = dtype if (dtype is not None and b.is_floating_point()) else b.dtype
            if b.device != device or b.dtype != want:
                m._buffers[k] = b.to(device=device, dtype=want)


@contextlib.contextmanager
def kept_state(
    model: nn.Module,
    device: torch.device,
    dtype: torch.dtype | None,
    *,
    dropout: bool = False,
    weights: bool = False,
) -> Iterator[CallerWeights | None]:
    """The run's state inside `caller_state`: train mode, dropout off unless `dropout`,
    the run's device and dtype. Yields the kept parameter values when `weights` (the
    run writes them: optimizer steps), else None."""
    with caller_state(model, weights=weights) as kept:
        model.train()
        with contextlib.ExitStack() as stack:
            if not dropout:
                stack.enter_context(_no_dropout(model))
            _cast(model, device, dtype)
            yield kept


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """Every module in eval mode for a small structural pass (the layout probe, reading a
    factory's output, measuring usage for --init), each one's own mode put back after."""
    modes = [(m, m.training) for m in model.modules()]
    try:
        model.eval()
        yield
    finally:
        for m, mode in modes:
            m.training = mode
