"""From the recorded pass's raw sums to the frozen records a Report holds.

One `LayerRecord` per recorded module (in module order, those that ran), the residual
stream's points with their per-token views (each stream's, for an encoder-decoder), the
growth fit and its summary, the branches, and the per-channel maxima `--plot` draws.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import nn

from actscan.measure.profile import Profiled
from actscan.measure.stats import layer_record, stream_points
from actscan.measure.streams import primary, stream_records
from actscan.measure.tokens import Decode, channel_maxima, streams_with_views, with_views
from actscan.records import (
    BranchRecord,
    GrowthFit,
    LayerRecord,
    StreamPoint,
    StreamRecord,
    Summary,
    all_points,
    growth_fit,
    stream_branch_records,
)

if TYPE_CHECKING:
    from actscan.diagnose.thresholds import Thresholds

__all__ = ["Measured", "build_records"]


@dataclass(frozen=True)
class Measured:
    """The pass's records: what the checks read and the Report holds."""

    layers: tuple[LayerRecord, ...]
    stream: tuple[StreamPoint, ...]
    streams: tuple[StreamRecord, ...]
    fit: GrowthFit
    summary: Summary
    branches: tuple[BranchRecord, ...]
    channel_maxima: tuple[tuple[str, tuple[float, ...]], ...] = field(default=(), repr=False)


def type_name(mod: nn.Module) -> str:
    """The module's class name; FSDP2's wrapper class (`FSDPBlock`) reads as `Block`."""
    cls = type(mod)
    if cls.__name__.startswith("FSDP") and len(cls.__mro__) > 2:
        from torch.distributed.fsdp import FSDPModule

        if issubclass(cls, FSDPModule):
            return next(c for c in cls.__mro__[1:] if not issubclass(c, FSDPModule)).__name__
    return cls.__name__


def build_records(
    model: nn.Module,
    profiled: Profiled,
    th: Thresholds,
    decode_token: Decode | None = None,
) -> Measured:
    """The records of `profiled` (its inputs and `decode_token` label the per-token view)."""
    raw, layout, source = profiled.raw, profiled.layout, profiled.chosen.source
    batches = profiled.spec.batches
    mods = dict(model.named_modules())
    records = {
        name: layer_record(
            r,
            type_name=type_name(mods[name]) if name in mods else "StreamInput",
            role=layout.role(name) if name in mods else "stream",
            block=layout.block_of.get(name),
            batches=batches,
            th=th,
        )
        for name, r in raw.items()
    }
    layers = tuple(records[n] for n in profiled.targets if records[n].calls > 0)
    streams = stream_records(layout, records)  # () unless an encoder-decoder
    main = primary(streams) if layout.streams else None
    stream = (
        main.points if main is not None else stream_points(layout, records, profiled.stream_input)
    )
    stream = with_views(stream, raw, source, decode_token)
    streams = streams_with_views(streams, raw, source, decode_token)
    fit = growth_fit(stream)
    summary = Summary(
        growth_exponent=fit.exponent,
        gain_per_block=fit.gain,
        growth=fit.growth,
        var_intercept=fit.var_a,
        var_slope=fit.var_b,
        grad_ratio=fit.grad_ratio,
    )
    return Measured(
        layers=layers,
        stream=stream,
        streams=streams,
        fit=fit,
        summary=summary,
        branches=stream_branch_records(layout, layers, stream, streams),
        channel_maxima=channel_maxima(all_points(stream, streams), raw),
    )
