"""Parameter records: mean/std of every parameter, and what kind of tensor it is.

At init the probe pass (actscan.layout.probe, shared with the layout proof) says how each
parameter is used: a weight's fan-in is the size of the dimension its matmul contracts,
whatever its shape, and each norm's effective gain is probed. Without it, kind and fan-in
are guessed from module types and shapes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

from actscan.layout.detect import is_norm
from actscan.layout.probe import Probe
from actscan.layout.usage import Usage
from actscan.measure.recorder import moments
from actscan.records import Layout, ParamRecord

__all__ = ["param_records"]

Moments = Callable[[Sequence[torch.Tensor]], list[tuple[float, float, int]]]


def _fan(mod: nn.Module, shape: tuple[int, ...]) -> tuple[int | None, int | None]:
    if len(shape) < 2:
        return None, None
    if type(mod).__name__ == "Conv1D":  # HF GPT-2 stores (in, out)
        return shape[0], shape[1]
    rf = 1
    for s in shape[2:]:
        rf *= s
    return shape[1] * rf, shape[0] * rf


def _measured(
    usage: Usage, full: str, shape: tuple[int, ...], kind: str, of_norm: bool
) -> tuple[str, int | None, int | None]:
    """(kind, fan_in, fan_out) from how the forward pass used the parameter."""
    use = usage.role(full)
    if of_norm and use is None:
        return kind, None, None  # norm gains and biases: judged on the norm's own terms
    if use is None:
        return ("scalar" if len(shape) <= 1 and math.prod(shape) <= 1 else "structured"), None, None
    if use.op == "embedding":
        return "embedding", None, None
    if use.op == "bias":
        return "bias", None, None
    return "weight", use.fan_in, use.fan_out


def _guessed_kind(mod: nn.Module, pname: str, p: torch.Tensor) -> str:
    """The parameter's kind from its module's type and its shape."""
    if isinstance(mod, nn.Embedding) or type(mod).__name__.endswith("Embedding"):
        return "embedding"
    if is_norm(mod):
        return "norm-gain" if pname == "weight" else "bias"
    if p.dim() >= 2:
        return "weight"
    if pname == "bias":
        return "bias"
    if p.dim() <= 1 and p.numel() <= 1:
        return "scalar"
    return "other"


def param_records(
    model: nn.Module,
    layout: Layout,
    at_init: Probe | None = None,
    *,
    measure: Moments = moments,
) -> tuple[ParamRecord, ...]:
    """mean/std/non-finite count of every parameter, one host transfer for all.

    With `at_init.usage` (the probe pass at init, actscan.layout.probe), kind and fan-in
    come from how the forward pass used each parameter, and `at_init.gains` (norm module →
    effective gain mean, std) replace reading a norm's `weight` as its gain; without, they
    are guessed from module types and shapes. `measure` gives (mean, std, non-finite) per
    tensor (a distributed run's merges the ranks' shards exactly).
    """
    usage = at_init.usage if at_init is not None else None
    gains = (at_init.gains if at_init is not None else None) or {}
    seen: set[int] = set()
    entries: list[tuple[str, str, nn.Module, nn.Parameter]] = []
    for mname, mod in model.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            entries.append((f"{mname}.{pname}" if mname else pname, mname, mod, p))
    if not entries:
        return ()
    host = measure([p for _, _, _, p in entries])  # fast passes; Welford is 10× slower
    out = []
    for (full, mname, mod, p), (mean, std, bad) in zip(entries, host, strict=True):
        shape = tuple(p.shape)
        fan_in, fan_out = _fan(mod, shape)
        kind = _guessed_kind(mod, full.rsplit(".", 1)[-1], p)
        gain = gains.get(mname) if kind == "norm-gain" else None
        if usage is not None:
            kind, fan_in, fan_out = _measured(usage, full, shape, kind, is_norm(mod))
        out.append(
            ParamRecord(
                name=full,
                module=mname,
                role=layout.role(mname),
                block=layout.block_of.get(mname),
                shape=shape,
                mean=mean,
                std=std,
                fan_in=fan_in,
                fan_out=fan_out,
                kind=kind,
                nonfinite=int(bad),
                gain=gain[0] if gain else None,
                gain_std=gain[1] if gain else None,
                normed=usage is not None and kind == "weight" and usage.normed(full),
                periodic=usage is not None and kind == "weight" and usage.periodic(full),
                unit_input=(
                    usage is not None
                    and kind == "weight"
                    and (use := usage.role(full)) is not None
                    and use.unit_input
                ),
            )
        )
    return tuple(out)
