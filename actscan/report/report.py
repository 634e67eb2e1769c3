"""The Report: everything one scan measured and concluded, and its JSON form.

No torch here: a Report is plain data, so it can be rebuilt from JSON, compared and
rendered without a model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from actscan.records import (
    AttentionRecord,
    BlockProof,
    BranchRecord,
    Dynamics,
    FailOn,
    Finding,
    LayerRecord,
    LowPrecRecord,
    ModelInfo,
    ParamRecord,
    RunInfo,
    Severity,
    Skip,
    StreamPoint,
    StreamRecord,
    Summary,
    TraceRecord,
    block_updates,
    json_as,
)
from actscan.report.codec import from_json_obj, to_json_obj
from actscan.report.output import dumps
from actscan.version import __version__

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Report:
    model: ModelInfo
    run: RunInfo
    layers: tuple[LayerRecord, ...]
    stream: tuple[StreamPoint, ...]
    findings: tuple[Finding, ...] = ()
    summary: Summary = field(default_factory=Summary)
    # taken before the run for the init checks; not in the JSON
    params: tuple[ParamRecord, ...] = field(default=(), metadata=json_as(skip=True))
    notes: tuple[str, ...] = ()  # structure/run remarks shown to the user
    branches: tuple[BranchRecord, ...] = ()
    layout: tuple[BlockProof, ...] = ()  # the layout self-check, per block
    skipped: tuple[Skip, ...] = ()  # checks that did not run, with the reason
    # every residual stream when there are several (encoder-decoder); `stream` and
    # `summary` are the primary one's
    streams: tuple[StreamRecord, ...] = ()
    # the first optimizer steps (`--steps N`, `scan(steps=N)`); None: step 0 only
    dynamics: Dynamics | None = field(default=None, metadata=json_as(omit_none=True))
    # per attention layer: its heads' score max/std, entropy and sink (attention probes)
    attention: tuple[AttentionRecord, ...] = ()
    # (stream point, per-channel max-abs) for `profile --plot`'s heat map. Not in the JSON:
    # d values per point (4096 × 33 for a 32-layer 4k model, ~2 MB of text) would dwarf
    # the report; a report read back from JSON has none (the plot says so).
    channel_maxima: tuple[tuple[str, tuple[float, ...]], ...] = field(
        default=(), repr=False, compare=False, metadata=json_as(skip=True)
    )
    # the first operation out of range, from one batch rerun op by op (`--trace`, or
    # automatic when the run overflowed or diverged); None: no trace ran
    trace: TraceRecord | None = field(default=None, metadata=json_as(omit_none=True))
    # every GEMM operand cast in each `--formats` format; empty when off
    low_precision: tuple[LowPrecRecord, ...] = ()

    def __post_init__(self) -> None:
        # A plain dict (the pre-typed form) is still accepted and becomes a Summary.
        if not isinstance(self.summary, Summary) and isinstance(self.summary, Mapping):
            object.__setattr__(self, "summary", Summary.from_mapping(self.summary))

    # -- lookups -------------------------------------------------------------------
    def layer(self, name: str) -> LayerRecord:
        for rec in self.layers:
            if rec.name == name:
                return rec
        raise KeyError(name)

    def worst(self) -> Severity | None:
        if not self.findings:
            return None
        return max((f.severity for f in self.findings), key=lambda s: s.rank)

    def failed(self, fail_on: str | FailOn = FailOn.ERROR) -> list[Finding]:
        gate = FailOn(fail_on)
        return [f for f in self.findings if gate.trips(f.severity)]

    # -- serialisation ---------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The JSON report (docs/report-format.md): the envelope, then every field."""
        return {
            "schema_version": SCHEMA_VERSION,
            "tool": {"name": "actscan", "version": __version__},
            **to_json_obj(self),
        }

    def to_json(self, indent: int | None = 2) -> str:
        return dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Report:
        """A Report from its JSON form (`to_dict`, or `json.loads` of a report file)."""
        report = from_json_obj(cls, data)
        dyn = report.dynamics
        if dyn is not None and "blocks" not in data["dynamics"]:  # written before blocks
            report = replace(report, dynamics=replace(dyn, blocks=block_updates(dyn.updates)))
        return report

    def assert_healthy(self, fail_on: str | FailOn = FailOn.WARN) -> None:
        """Raise AssertionError listing every finding at or above `fail_on` (for pytest)."""
        bad = self.failed(fail_on)
        if bad:
            lines = [f"actscan: {len(bad)} finding(s) at or above {FailOn(fail_on).value}:"]
            lines += [
                f"  [{f.severity.value}] {f.check}: {f.message}"
                + (f" ({', '.join(f.layers[:4])})" if f.layers else "")
                for f in bad
            ]
            raise AssertionError("\n".join(lines))
