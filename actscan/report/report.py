"""The Report: everything one scan measured and concluded, and its JSON form.

No torch here: a Report is plain data, so it can be rebuilt from JSON, compared and
rendered without a model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from actscan.records import (
    AttentionRecord,
    BlockProof,
    BranchRecord,
    Dynamics,
    FailOn,
    Finding,
    HeadRecord,
    LayerRecord,
    ModelInfo,
    ParamRecord,
    RunInfo,
    Severity,
    Skip,
    StreamPoint,
    StreamRecord,
    Summary,
    TopValue,
)
from actscan.report.output import dumps, json_safe
from actscan.report.steps_io import dynamics_from_dict, dynamics_to_dict
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
    params: tuple[ParamRecord, ...] = ()
    notes: tuple[str, ...] = ()  # structure/run remarks shown to the user
    branches: tuple[BranchRecord, ...] = ()
    layout: tuple[BlockProof, ...] = ()  # the layout self-check, per block
    skipped: tuple[Skip, ...] = ()  # checks that did not run, with the reason
    # every residual stream when there are several (encoder-decoder); `stream` and
    # `summary` are the primary one's
    streams: tuple[StreamRecord, ...] = ()
    # the first optimizer steps (`--steps N`, `scan(steps=N)`); None: step 0 only
    dynamics: Dynamics | None = None
    # per attention layer: its heads' score max/std, entropy and sink (attention probes)
    attention: tuple[AttentionRecord, ...] = ()
    # (stream point, per-channel max-abs) for `profile --plot`'s heat map. Not in the JSON:
    # d values per point (4096 × 33 for a 32-layer 4k model, ~2 MB of text) would dwarf
    # the report; a report read back from JSON has none (the plot says so).
    channel_maxima: tuple[tuple[str, tuple[float, ...]], ...] = field(
        default=(), repr=False, compare=False
    )

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
        model = asdict(self.model)
        return json_safe(
            {
                "schema_version": SCHEMA_VERSION,
                "tool": {"name": "actscan", "version": __version__},
                "model": model,
                "run": asdict(self.run),
                "layers": [asdict(r) for r in self.layers],
                "stream": [asdict(p) for p in self.stream],
                "findings": [
                    {**asdict(f), "severity": f.severity.value, "layers": list(f.layers)}
                    for f in self.findings
                ],
                "summary": dict(self.summary),
                "notes": list(self.notes),
                "branches": [asdict(b) for b in self.branches],
                "layout": [asdict(p) for p in self.layout],
                "skipped": [asdict(s) for s in self.skipped],
                "streams": [
                    {
                        "name": s.name,
                        "container": s.container,
                        "primary": s.primary,
                        "points": [asdict(p) for p in s.points],
                        "summary": dict(s.summary),
                    }
                    for s in self.streams
                ],
                **({"dynamics": dynamics_to_dict(self.dynamics)} if self.dynamics else {}),
                "attention": [
                    {**asdict(a), "heads": [asdict(h) for h in a.heads]} for a in self.attention
                ],
            }
        )

    def to_json(self, indent: int | None = 2) -> str:
        return dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Report:
        def build(tp: type, d: dict[str, Any]) -> Any:
            names = {f.name for f in fields(tp)}
            return tp(**{k: v for k, v in d.items() if k in names})

        layers = tuple(
            build(LayerRecord, {**d, "outlier_channels": tuple(d.get("outlier_channels", ()))})
            for d in data["layers"]
        )
        findings = tuple(
            build(
                Finding,
                {**d, "severity": Severity(d["severity"]), "layers": tuple(d["layers"])},
            )
            for d in data["findings"]
        )
        return cls(
            model=build(ModelInfo, data["model"]),
            run=build(RunInfo, data["run"]),
            layers=layers,
            stream=tuple(_point(d) for d in data["stream"]),
            findings=findings,
            summary=Summary.from_mapping(data.get("summary", {})),
            notes=tuple(data.get("notes", ())),
            branches=tuple(build(BranchRecord, d) for d in data.get("branches", ())),
            layout=tuple(
                build(
                    BlockProof,
                    {**d, **{k: tuple(d.get(k, ())) for k in ("writes", "roles", "norms")}},
                )
                for d in data.get("layout", ())
            ),
            skipped=tuple(build(Skip, d) for d in data.get("skipped", ())),
            streams=tuple(
                StreamRecord(
                    name=d["name"],
                    container=d.get("container"),
                    primary=bool(d.get("primary")),
                    points=tuple(_point(p) for p in d.get("points", ())),
                    summary=Summary.from_mapping(d.get("summary", {})),
                )
                for d in data.get("streams", ())
            ),
            dynamics=dynamics_from_dict(data["dynamics"]) if data.get("dynamics") else None,
            attention=tuple(
                build(
                    AttentionRecord,
                    {**d, "heads": tuple(build(HeadRecord, h) for h in d.get("heads", ()))},
                )
                for d in data.get("attention", ())
            ),
        )

    def to_markdown(self, fail_on: str | FailOn = FailOn.ERROR) -> str:
        from actscan.render.formats import to_markdown

        return to_markdown(self, fail_on=fail_on)

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


def _known(tp: type, d: Mapping[str, Any]) -> dict[str, Any]:
    names = {f.name for f in fields(tp)}
    return {k: v for k, v in d.items() if k in names}


def _point(d: Mapping[str, Any]) -> StreamPoint:
    """A stream point from JSON, its `top_values` back as TopValue records."""
    tops = tuple(TopValue(**_known(TopValue, t)) for t in d.get("top_values") or ())
    return StreamPoint(**{**_known(StreamPoint, d), "top_values": tops})
