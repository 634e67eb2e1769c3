"""Exact merge of the recorder's accumulators across ranks: a few collectives in all.

Each rank's `Recorder` accumulates its own rows of every batch, as a one-process run
does. Right before its one host transfer (`Recorder.result`), `merge_recorder` combines
the ranks' accumulators in place, driven by the recorder's declaration `Recorder.MERGE`:
one entry per state attribute, naming how it reduces
(docs/design.md, "Distributed runs"). All attributes of one kind travel together, so
the cost is one collective per kind, whatever the number of modules, batches or
statistics:

    "sum"       all-reduce SUM (fp64: counts stay exact, sums of squares add up)
    "max"       all-reduce MAX          "min"  all-reduce MIN
    "chan"      a group "n,mean,m2": all-gather of the triples, merged in rank order
                (actscan.measure.moments: no Σx² − n·mean² cancellation)
    "channels"  per-module per-channel (amax, amin) pairs: MAX of amax and of −amin
    "cat"       all-gather, concatenated along dim 0 in rank order (for candidates that
                the recorder cuts down in `result()`, e.g. a top-k)

An attribute may be a device tensor, a list of ints (host counters), or, for "channels",
a list of optional (hi, lo) tensor pairs. Every rank ends with the merged values, so
every rank computes the same stream, branches and findings; only rank 0 renders.
A new statistic joins the merge with one line in `Recorder.MERGE`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import torch

from actscan.distributed.telemetry import note_merge_ms
from actscan.measure.moments import Moments, merge_moments
from actscan.measure.recorder import TOP_K

_F64 = torch.float64


def _dist() -> Any:
    import torch.distributed as dist

    return dist


def _as_tensor(value: Any, dev: torch.device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().to(dev, _F64).reshape(-1)
    if value and isinstance(value[0], torch.Tensor):  # a list of tensors
        return torch.cat([v.detach().to(dev, _F64).reshape(-1) for v in value])
    return torch.tensor([float(v) for v in value], dtype=_F64, device=dev)


def _put_back(obj: Any, attr: str, merged: torch.Tensor) -> None:
    old = getattr(obj, attr)
    if isinstance(old, torch.Tensor):
        old.copy_(merged.view(old.shape).to(old.dtype))
    elif old and isinstance(old[0], torch.Tensor):
        pos = 0
        for t in old:
            t.copy_(merged[pos : pos + t.numel()].view(t.shape).to(t.dtype))
            pos += t.numel()
    else:
        setattr(obj, attr, [type(v)(x) for v, x in zip(old, merged.tolist(), strict=True)])


def _reduce(obj: Any, attrs: Sequence[str], op: Any, dev: torch.device) -> None:
    """One all-reduce for every attribute of one kind."""
    if not attrs:
        return
    parts = [_as_tensor(getattr(obj, a), dev) for a in attrs]
    flat = torch.cat(parts)
    if flat.numel():
        _dist().all_reduce(flat, op=op)
    pos = 0
    for a, p in zip(attrs, parts, strict=True):
        _put_back(obj, a, flat[pos : pos + p.numel()])
        pos += p.numel()


def _gather(t: torch.Tensor, world: int) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(world)]
    _dist().all_gather(out, t.contiguous())
    return out


def _chan(obj: Any, groups: Sequence[str], dev: torch.device, world: int) -> None:
    """Chan's merge of every (n, mean, m2) group, one all-gather for all of them."""
    if not groups:
        return
    names = [g.split(",") for g in groups]
    stacked = torch.stack(
        [
            torch.cat([_as_tensor(getattr(obj, a), dev) for a in trio])
            for trio in zip(*names, strict=True)
        ]
    )  # (3, Σm)
    ranks = _gather(stacked, world)
    moments: Moments = (ranks[0][0], ranks[0][1], ranks[0][2])
    for bn, bmean, bm2 in ranks[1:]:  # in rank order
        moments = merge_moments(moments, (bn, bmean, bm2))
    merged = torch.stack(moments)
    pos = 0
    for trio in names:
        k = _as_tensor(getattr(obj, trio[0]), dev).numel()
        for j, a in enumerate(trio):
            _put_back(obj, a, merged[j, pos : pos + k])
        pos += k


def _channels(obj: Any, attrs: Sequence[str], dev: torch.device) -> None:
    """Per-channel (amax, amin) pairs: one MAX all-reduce of [amax, −amin] for all."""
    slots = [
        (a, i, pair) for a in attrs for i, pair in enumerate(getattr(obj, a)) if pair is not None
    ]
    if not slots:
        return
    flat = torch.cat(
        [
            torch.cat([hi.reshape(-1).to(dev, _F64), lo.reshape(-1).to(dev, _F64).neg()])
            for _, _, (hi, lo) in slots
        ]
    )
    _dist().all_reduce(flat, op=_dist().ReduceOp.MAX)
    pos = 0
    for _, _, (hi, lo) in slots:
        k = hi.numel()
        hi.copy_(flat[pos : pos + k].view(hi.shape).to(hi.dtype))
        lo.copy_(flat[pos + k : pos + 2 * k].neg().view(lo.shape).to(lo.dtype))
        pos += 2 * k


def _cat(obj: Any, attrs: Sequence[str], world: int) -> None:
    for a in attrs:
        value = getattr(obj, a)
        if isinstance(value, torch.Tensor):
            setattr(obj, a, torch.cat(_gather(value, world)))
        else:  # a list of tensors: each concatenated over the ranks
            setattr(obj, a, [torch.cat(_gather(v, world)) for v in value])


def merge_state(obj: Any, spec: dict[str, str], device: torch.device) -> None:
    """Merge `obj`'s attributes across all ranks in place, as `spec` declares."""
    dist = _dist()
    world = dist.get_world_size()
    start = time.perf_counter()
    by_op: dict[str, list[str]] = {}
    for attrs, op in spec.items():
        by_op.setdefault(op, []).extend([attrs] if op == "chan" else attrs.split(","))
    unknown = set(by_op) - {"sum", "max", "min", "chan", "channels", "cat"}
    if unknown:
        raise ValueError(f"unknown merge op(s) {sorted(unknown)} in {type(obj).__name__}.MERGE")
    _chan(obj, by_op.get("chan", []), device, world)
    _reduce(obj, by_op.get("sum", []), dist.ReduceOp.SUM, device)
    _reduce(obj, by_op.get("max", []), dist.ReduceOp.MAX, device)
    _reduce(obj, by_op.get("min", []), dist.ReduceOp.MIN, device)
    _channels(obj, by_op.get("channels", []), device)
    _cat(obj, by_op.get("cat", []), world)
    note_merge_ms((time.perf_counter() - start) * 1e3)  # telemetry (benchmarks)


def merge_recorder(rec: Any) -> None:
    """`Recorder(merge=...)` hook: merge its accumulators across the current run's ranks."""
    merge_state(rec, type(rec).MERGE, rec.device)
    merge_token_views(rec)


def merge_token_views(rec: Any) -> None:
    """The per-token views of the stream points: the global top-k, exactly, and the
    sampled median |x| and channel hit counts.

    A rank holds rows [rank·r, (rank+1)·r) of each batch (data parallel), so its position
    code batch·n + i (n = its tensor's numel) is batch·N + rank·n + i in the global
    tensor (N = world·n); the ranks' candidates are gathered (one all-gather for all
    points) and cut to the top k. The median |x| is the median of the ranks' per-batch
    sample medians and the hit counts add up: both are samples already (docs/design.md).
    """
    ids = sorted(rec._tok_top)
    if not ids:
        return

    dist = _dist()
    world, rank = dist.get_world_size(), dist.get_rank()
    dev = rec.device
    sizes = [rec._tok_top[i][1].numel() for i in ids]
    parts = []
    for i in ids:
        _, vals, codes = rec._tok_top[i]
        n = math.prod(rec._tok_shape[i])
        codes = codes.to(dev, _F64)
        batch = torch.div(codes, n, rounding_mode="floor")
        glob = batch * (n * world) + rank * n + (codes - batch * n)
        parts += [vals.to(dev, _F64), glob]
    ranks = _gather(torch.cat(parts), world)
    pos = 0
    for i, k in zip(ids, sizes, strict=True):
        vals = torch.cat([r[pos : pos + k] for r in ranks])
        codes = torch.cat([r[pos + k : pos + 2 * k] for r in ranks])
        pos += 2 * k
        pick = vals.abs().topk(min(TOP_K, vals.numel())).indices
        old = rec._tok_top[i][1]
        v = vals[pick].to(old.dtype)
        rec._tok_top[i] = (v.abs(), v, codes[pick].to(rec._tok_top[i][2].dtype))
        shape = rec._tok_shape[i]
        rec._tok_shape[i] = (shape[0] * world, *shape[1:]) if shape else shape
    meds = torch.stack([torch.stack(rec._tok_med[i]).to(dev, _F64) for i in ids])  # (m, b)
    gathered = torch.cat(_gather(meds, world), dim=1)
    for row, i in enumerate(ids):
        rec._tok_med[i] = [gathered[row, j] for j in range(gathered.shape[1])]
    hits = [(i, h) for i in ids if (h := rec._tok_hits.get(i))]
    if hits:
        flat = torch.cat([torch.cat([a.to(dev, _F64), b.to(dev, _F64)]) for _, (a, b) in hits])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        pos = 0
        for _, (a, b) in hits:
            a.copy_(flat[pos : pos + a.numel()].to(a.dtype))
            b.copy_(flat[pos + a.numel() : pos + 2 * a.numel()].to(b.dtype))
            pos += 2 * a.numel()


def sharded_moments(tensors: Sequence[torch.Tensor]) -> list[tuple[float, float, int]]:
    """(mean, std, non-finite count) of each (possibly sharded) parameter, over all ranks.

    Each rank reduces its local shards (DTensor `to_local()`) to (n, mean, M2, non-finite)
    in fp64, one all-gather carries them all, and Chan's merge gives the whole tensor's
    moments: what `moments()` of the unsharded tensor gives, to fp64 rounding.
    """
    from torch.distributed.tensor import DTensor

    dist = _dist()
    rows = []
    for t in tensors:
        x = t.detach()
        local = x.to_local() if isinstance(x, DTensor) else x
        if not local.is_floating_point() or local.numel() == 0:
            rows.append(torch.zeros(4, dtype=_F64))
            continue
        v = local.reshape(-1).to(_F64)
        finite = torch.isfinite(v)
        bad = (~finite).sum().to(_F64)
        var, mean = torch.var_mean(v, correction=0)
        rows.append(
            torch.stack(
                [torch.tensor(float(v.numel()), dtype=_F64), mean, var * v.numel(), bad]
            ).cpu()
        )
    if not rows:
        return []
    mine = torch.stack(rows)
    nccl = dist.get_backend() == "nccl"  # nccl gathers device tensors only
    mine_d = mine.to(torch.device("cuda", torch.cuda.current_device())) if nccl else mine
    ranks = [r.cpu() for r in _gather(mine_d, dist.get_world_size())]
    n, mean, m2, bad = ranks[0].unbind(1)
    for other in ranks[1:]:  # in rank order
        bn, bmean, bm2, bbad = other.unbind(1)
        n, mean, m2 = merge_moments((n, mean, m2), (bn, bmean, bm2))
        bad = bad + bbad
    out = []
    for k in range(len(tensors)):
        cnt = float(n[k])
        if cnt == 0:
            out.append((0.0, 0.0, 0))
            continue
        var_k = float(m2[k]) / cnt
        std = max(var_k, 0.0) ** 0.5 if var_k == var_k else var_k
        out.append((float(mean[k]), std, int(bad[k])))
    return out
