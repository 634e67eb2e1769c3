"""The per-token view of the residual stream: where its largest values sit.

The recorder keeps, at each stream point, the top-k |x| with their flat positions in one
batch's tensor, and the median |x| (RawStats.top / shape / median_abs). Here the positions
become (sequence, token, channel), the token ids are read off the batch that was run, and
the points of the report get their `top_values`, `median_abs`, `token_grad_rel` and
`token_grad_median`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

import torch

from actscan.measure.inputs import InputSource
from actscan.measure.recorder import RawStats
from actscan.records import StreamPoint, StreamRecord, TopValue

Decode = Callable[[int], str]


def stream_names(block_names: Sequence[str], inputs: Sequence[str], embed: str | None) -> list[str]:
    """The records that get the per-token view: each stream's input and every block's
    output, plus the embedding (often the same tensor as the stream input: reduced once)."""
    return [*inputs, *block_names, *([embed] if embed else [])]


def top_values(
    raw: RawStats, source: InputSource | None = None, decode: Decode | None = None
) -> tuple[TopValue, ...]:
    """The recorded top-k of one stream point as TopValues, largest |x| first.

    A tensor of shape (..., T, C) has value i at channel i % C, row i // C, token row % T,
    sequence row // T; a 2-d (N, C) tensor has no sequences (token = row). The token id is
    looked up when the batch's input_ids have the tensor's (sequence, token) shape.
    """
    shape = raw.shape
    if not raw.top or not shape:
        return ()
    c = shape[-1] if len(shape) >= 2 else 1
    t = shape[-2] if len(shape) >= 3 else None
    ids_of: dict[int, torch.Tensor | None] = {}
    out = []
    for value, batch, idx in raw.top:
        row, channel = divmod(idx, c) if len(shape) >= 2 else (idx, 0)
        seq, tok = divmod(row, t) if t else (None, row)
        token_id = None
        if source is not None and seq is not None:
            if batch not in ids_of:
                ids = source(batch).token_ids
                ids_of[batch] = ids if ids is not None and ids.dim() == 2 else None
            ids = ids_of[batch]
            if ids is not None and seq < ids.shape[0] and tok < ids.shape[1] and t == ids.shape[1]:
                token_id = int(ids[seq, tok])
        text = decode(token_id) if decode is not None and token_id is not None else None
        out.append(
            TopValue(
                value=value,
                token=tok,
                channel=channel,
                sequence=seq,
                batch=batch,
                token_id=token_id,
                text=text,
            )
        )
    return tuple(out)


def with_views(
    points: Sequence[StreamPoint],
    raw: Mapping[str, RawStats],
    source: InputSource | None,
    decode: Decode | None = None,
) -> tuple[StreamPoint, ...]:
    """The points with their per-token view (unchanged where none was recorded)."""
    out = []
    for p in points:
        r = raw.get(p.name)
        if r is None or not r.top:
            out.append(p)
            continue
        rel = med = None
        if r.token_grad_sumsq is not None and r.token_rows and r.shape:
            rel = math.sqrt(max(r.token_grad_sumsq, 0.0) / r.token_rows) / r.shape[-1]
        if r.token_grad_median is not None and r.shape:
            med = r.token_grad_median / r.shape[-1]
        out.append(
            replace(
                p,
                top_values=top_values(r, source, decode),
                median_abs=r.median_abs,
                token_grad_rel=rel,
                token_grad_median=med,
            )
        )
    return tuple(out)


def streams_with_views(
    streams: Sequence[StreamRecord],
    raw: Mapping[str, RawStats],
    source: InputSource | None,
    decode: Decode | None = None,
) -> tuple[StreamRecord, ...]:
    return tuple(replace(s, points=with_views(s.points, raw, source, decode)) for s in streams)


def channel_maxima(
    points: Sequence[StreamPoint], raw: Mapping[str, RawStats]
) -> tuple[tuple[str, tuple[float, ...]], ...]:
    """(stream point, its per-channel max-abs) where recorded: the plot's heat map."""
    return tuple(
        (p.name, chan) for p in points if p.name in raw and (chan := raw[p.name].channel_max)
    )
