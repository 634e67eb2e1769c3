"""Several residual streams: an encoder-decoder's encoder and decoder, each on its own.

`layout.detect.find_streams` finds the block lists; here each one gets its own points (k = 0
at its first block's input, then each block's output) and its own growth fit, from the
same layer records `stats` works on. The last stream in execution order (the decoder,
which feeds the head) is the primary one: its points are the report's `stream` and its
fit the `summary`, so readers of a single stream keep working. Pure: no torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from actscan.measure.stats import stream_points
from actscan.records import LayerRecord, Layout, StreamPoint, StreamRecord, Summary, growth_fit


def input_name(block: str) -> str:
    """The record name of the stream entering `block` (the recorder's stream input)."""
    return f"{block}:input"


def stream_inputs(layout: Layout) -> list[str]:
    """The first block of each stream: its input is that stream's k = 0."""
    return [blocks[0].name for _, blocks in layout.stream_blocks() if blocks]


def summary_of(points: Sequence[StreamPoint]) -> Summary:
    return growth_fit(points).summary()


def stream_records(layout: Layout, records: Mapping[str, LayerRecord]) -> tuple[StreamRecord, ...]:
    """One record per stream when the layout has several, else () (the report's `stream`
    and `summary` are the one stream)."""
    if not layout.streams:
        return ()
    containers = dict(layout.streams)
    groups = [(name, blocks) for name, blocks in layout.stream_blocks() if blocks]
    out = []
    for i, (name, blocks) in enumerate(groups):
        points = stream_points(replace(layout, blocks=blocks), records, input_name(blocks[0].name))
        out.append(
            StreamRecord(
                name=name,
                container=containers.get(name),
                primary=i == len(groups) - 1,
                points=points,
                summary=summary_of(points),
            )
        )
    return tuple(out)


def primary(streams: Sequence[StreamRecord]) -> StreamRecord | None:
    return next((s for s in streams if s.primary), None)
