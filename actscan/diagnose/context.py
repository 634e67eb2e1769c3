"""What every check reads: the measured records of one run (CheckContext).

Its own module so that each check imports it without importing the registry that imports
the checks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from actscan.diagnose.thresholds import Thresholds
from actscan.records import (
    AttentionRecord,
    Dynamics,
    Finding,
    GrowthFit,
    LayerRecord,
    Layout,
    LowPrecRecord,
    ModelInfo,
    ParamRecord,
    RunInfo,
    Skip,
    StreamPoint,
    StreamRecord,
    TraceRecord,
)

__all__ = ["Check", "CheckContext"]


@dataclass(frozen=True)
class CheckContext:
    info: ModelInfo
    run: RunInfo
    layout: Layout
    layers: tuple[LayerRecord, ...]
    stream: tuple[StreamPoint, ...]
    fit: GrowthFit
    params: tuple[ParamRecord, ...]
    thresholds: Thresholds
    # Every residual stream when there are several (encoder-decoder): `stream` and `fit`
    # are then the primary (decoder) one's, and the depth checks run on each in turn.
    streams: tuple[StreamRecord, ...] = ()
    # the first optimizer steps, when the run took any (`--steps N`); None: step 0 only
    dynamics: Dynamics | None = None
    # per attention layer and head (attention probes); empty when off or not available
    attention: tuple[AttentionRecord, ...] = ()
    # the first operation out of range (`--trace`, or automatic when the run broke)
    trace: TraceRecord | None = None
    # per GEMM operand and format (`--formats`); empty when off
    low_precision: tuple[LowPrecRecord, ...] = ()


Check = Callable[[CheckContext], "list[Finding | Skip]"]
