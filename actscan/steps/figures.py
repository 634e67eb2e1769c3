"""The per-step figures of `--steps`, each declared once, and the one transfer per step.

Why a declaration: every figure a step takes is a sum (of squares, of |x|, counts) or a
maximum, so that a distributed run's ranks meet in one SUM and one MAX all-reduce and get
the one-process figure exactly. `StepFigures` names each figure with its reduction beside
it; `exchange` lays the taken figures out in two flat tensors, reduces them and brings them
to the host in one copy, and hands them back by name in their own shapes. Nothing reads a
figure by its position, so a new figure is one field here, the code that takes it on the
device and the code that reads it on the host (`actscan.steps.loop`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import torch

SUM = "sum"
MAX = "max"
_IDENTITY = {SUM: 0.0, MAX: -math.inf}  # what adds nothing to a SUM, or to a MAX


# a figure's metadata: how the processes' values meet
_SUM: dict[str, Any] = {"reduce": SUM}
_MAX: dict[str, Any] = {"reduce": MAX}


@dataclass
class StepFigures:
    """One step's figures: fp64 tensors on the device while the step takes them, CPU
    tensors of the same shapes once `exchange` brought them over. A figure the step does
    not take stays None (the stream at t = 0, the update after the last measurement)."""

    # the probe, per point (points, 5): Σ(x_t − x_0)², Σx_0², Σ|x_t|, Σ|x_t − x_0|, count
    # (NaN: the point gave no output)
    change: torch.Tensor | None = field(default=None, metadata=_SUM)
    # the probe's vocabulary logits (4,): count, Σ(log Z − log V), Σ(log Z − log V)², NaN flag
    logits: torch.Tensor | None = field(default=None, metadata=_SUM)
    # (1,): their max, −inf without vocabulary logits
    logit_max: torch.Tensor | None = field(default=None, metadata=_MAX)
    # per attention layer: 1 where its largest |score| is NaN, and that max (NaN → −inf)
    attn_nan: torch.Tensor | None = field(default=None, metadata=_SUM)
    attn_max: torch.Tensor | None = field(default=None, metadata=_MAX)
    # t ≥ 1, the step's batch, per stream point (points, 2): Σx², count (NaN: no output)
    stream: torch.Tensor | None = field(default=None, metadata=_SUM)
    # t ≥ 1, per stream point of the step's batch: > 0 where it holds an inf/nan (the count
    # of its extremes that are not finite)
    stream_bad: torch.Tensor | None = field(default=None, metadata=_SUM)
    # (1,): this process's share of the mean loss
    loss: torch.Tensor | None = field(default=None, metadata=_SUM)
    # per norm gain g: ‖g − 1‖² (None: the model has no gains)
    gain_sq: torch.Tensor | None = field(default=None, metadata=_SUM)
    # t < N, per trainable parameter: Σg² of the update's gradient (NaN: none), ‖W_t‖² and
    # ‖W_t − W_{t+1}‖²
    grad_sq: torch.Tensor | None = field(default=None, metadata=_SUM)
    w_sq: torch.Tensor | None = field(default=None, metadata=_SUM)
    dw_sq: torch.Tensor | None = field(default=None, metadata=_SUM)
    # t < N, per trainable parameter: ‖W_{t+1} − W_0‖² (the cumulative movement)
    drift_sq: torch.Tensor | None = field(default=None, metadata=_SUM)
    # t < N, per trainable parameter: > 0 where the update's gradient, or the weights the
    # update wrote (W_{t+1}), hold an inf/nan
    grad_bad: torch.Tensor | None = field(default=None, metadata=_SUM)
    update_bad: torch.Tensor | None = field(default=None, metadata=_SUM)

    def uncount(self) -> None:
        """Every figure taken so far becomes its reduction's identity: these rows are a
        replica of rows another process counts (a probe that runs whole on every rank)."""
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                setattr(self, f.name, torch.full_like(value, _IDENTITY[f.metadata["reduce"]]))


def exchange(
    figures: StepFigures,
    device: torch.device,
    reduce: Callable[[torch.Tensor, torch.Tensor], None],
) -> StepFigures:
    """The step's figures on the host, after `reduce(sums, maxima)` met them with the
    other processes' (in place; nothing in one process): one device-to-host copy."""
    taken = [(f.name, f.metadata["reduce"], getattr(figures, f.name)) for f in fields(figures)]
    sums = [(name, v) for name, op, v in taken if op == SUM and v is not None]
    maxima = [(name, v) for name, op, v in taken if op == MAX and v is not None]
    flat_sum, flat_max = _flat(sums, device), _flat(maxima, device)
    reduce(flat_sum, flat_max)
    host = torch.cat([flat_sum, flat_max]).cpu()  # the one transfer
    out = StepFigures()
    pos = 0
    for name, v in sums + maxima:
        setattr(out, name, host[pos : pos + v.numel()].view(v.shape))
        pos += v.numel()
    return out


def _flat(parts: list[tuple[str, torch.Tensor]], device: torch.device) -> torch.Tensor:
    if not parts:
        return torch.zeros(0, dtype=torch.float64, device=device)
    return torch.cat([v.to(device, torch.float64).reshape(-1) for _, v in parts])


def host_values(x: torch.Tensor | None) -> list[Any]:
    """A figure's values as (nested) Python floats; [] when it was not taken."""
    return [] if x is None else x.tolist()
