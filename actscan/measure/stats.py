"""Pure statistics over recorded values: layer records and the stream points.

No printing, no torch: these functions take the host-side RawStats the recorder
produced and return frozen records and plain numbers.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from actscan.measure.recorder import RawStats
from actscan.records import LayerRecord, Layout, StreamPoint

if TYPE_CHECKING:  # annotation only: importing diagnose here would cycle back to stats
    from actscan.diagnose.thresholds import Thresholds


def gauss_max(rms: float, n: int) -> float:
    """The largest |x| n Gaussian values of this RMS reach, about: √(2 ln n)·rms."""
    return math.sqrt(2.0 * math.log(max(n, 2))) * rms


def outlier_cut(med: float, rms: float | None, n: int, th: Thresholds) -> float:
    """The channel max-abs at which a channel is an outlier: outlier-ratio × the median
    channel's, and outlier-gauss × the maximum a Gaussian with the tensor's own RMS reaches
    over its n values (scale-free: the same at init scale and at trained scale), and the
    optional absolute floor outlier-abs."""
    floor = th.outlier_gauss * gauss_max(rms, n) if rms is not None and math.isfinite(rms) else 0.0
    return max(th.outlier_ratio * med, floor, th.outlier_abs)


def channel_outliers(
    channel_max: Sequence[float] | None,
    th: Thresholds,
    summary: tuple[int, int, float, float | None] | None = None,
    *,
    rms: float | None = None,
    n: int = 0,
    hits: Sequence[float] | None = None,
) -> tuple[float | None, tuple[int, ...], float | None, int | None]:
    """(max/median ratio, outlier indices, median channel max, dead channel count).

    summary: (dead, live, median, max of live) as the recorder computes them on the device
    (RawStats.channel_*); without it they are computed here. Only a module whose largest
    live channel reaches the cut is scanned for the indices. rms, n: the tensor's RMS and
    value count (the scale-free floor). hits: per channel, the fraction of its values above
    6 × RMS (stream points only): a channel under outlier-tokens is large on a few tokens
    only (massive activations, reported per token) and is not an outlier channel.
    """
    if not channel_max:
        return None, (), None, None
    if summary is None:
        live_v = [v for v in channel_max if v > 0.0 and math.isfinite(v)]
        summary = (
            channel_max.count(0.0)
            if isinstance(channel_max, tuple | list)
            else sum(1 for v in channel_max if v == 0.0),
            len(live_v),
            statistics.median(live_v) if live_v else 0.0,
            max(live_v) if live_v else None,
        )
    dead, live, med, top = summary
    if len(channel_max) < 4 or not live or top is None:
        return None, (), med, dead
    ratio = top / med if med > 0 else None
    cut = outlier_cut(med, rms, n, th)
    if top < cut:  # no live channel reaches it (+inf and NaN never count)
        return ratio, (), med, dead
    idx = tuple(i for i, v in enumerate(channel_max) if math.isfinite(v) and v >= cut)
    if hits is not None and len(hits) == len(channel_max):
        idx = tuple(i for i in idx if hits[i] >= th.outlier_tokens)
    return ratio, idx, med, dead


def layer_record(
    raw: RawStats, *, type_name: str, role: str, block: int | None, batches: int, th: Thresholds
) -> LayerRecord:
    has = raw.numel > 0
    rms = math.sqrt(max(raw.var + raw.mean * raw.mean, 0.0)) if has else None
    summary = None
    if raw.channel_live is not None and raw.channel_dead is not None:
        summary = (raw.channel_dead, raw.channel_live, raw.channel_median or 0.0, raw.channel_top)
    ratio, outliers, med, dead = channel_outliers(
        raw.channel_max, th, summary, rms=rms, n=raw.numel, hits=raw.channel_hits
    )
    grad_rms = grad_norm = None
    if raw.grad_sumsq is not None and raw.grad_numel:
        # grad_sumsq is per batch (averaged), grad_numel is over all batches
        grad_rms = math.sqrt(raw.grad_sumsq * batches / raw.grad_numel)
        grad_norm = math.sqrt(raw.grad_sumsq)
    return LayerRecord(
        name=raw.name,
        type=type_name,
        role=role,
        block=block,
        calls=max(1, round(raw.calls / max(batches, 1))) if raw.calls else 0,
        mean=raw.mean if has else None,
        std=math.sqrt(max(raw.var, 0.0))
        if has and not math.isnan(raw.var)
        else (float("nan") if has else None),
        rms=rms,
        max_abs=raw.max_abs if has else None,
        zero_frac=raw.zeros / raw.numel if has else None,
        nonfinite=raw.nonfinite,
        channel_max_ratio=ratio,
        outlier_channels=outliers,
        grad_rms=grad_rms,
        grad_norm=grad_norm,
        param_grad_norm=math.sqrt(raw.param_grad_sumsq)
        if raw.param_grad_sumsq is not None
        else None,
        numel=raw.numel // max(batches, 1),
        n_channels=len(raw.channel_max) if raw.channel_max else None,
        dead_channels=dead,
        channel_median_max=med,
        order=raw.order,
        underflow_frac=raw.underflow / raw.numel if raw.underflow is not None and has else None,
        grad_underflow_frac=raw.grad_underflow / raw.grad_numel
        if raw.grad_underflow is not None and raw.grad_numel
        else None,
    )


def stream_points(
    layout: Layout, records: Mapping[str, LayerRecord], input_name: str | None
) -> tuple[StreamPoint, ...]:
    """k = 0 at the first block's input, then each block's output at cumulative k."""
    if not layout.blocks:
        return ()
    pts: list[StreamPoint] = []

    def point(k: int, block: int | None, name: str) -> StreamPoint:
        rec = records.get(name)
        if rec is None:
            return StreamPoint(k=k, block=block, name=name, rms=None)
        return StreamPoint(
            k=k,
            block=block,
            name=name,
            rms=rec.rms,
            grad_rms=rec.grad_rms,
            mean=rec.mean,
            std=rec.std,
            max_abs=rec.max_abs,
        )

    if input_name is not None:
        pts.append(point(0, None, input_name))
    k = 0
    for b in layout.blocks:
        k += b.adds
        pts.append(point(k, b.index, b.name))
    return tuple(pts)
