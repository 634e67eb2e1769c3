"""`actscan sweep`: the same architecture at several depths, widths or learning rates,
one row per point.

Across sizes this is mup's coordinate check as a table: if the parameterization transfers
across size, the rows are flat (final stream RMS, growth, exponent and per-block gain
barely move as depth or width grows). Across learning rates (`--lrs` with `--steps N`) it
is the lr bracket: the highest lr whose first steps look like runs that trained (no
warn/error step finding at it or below), with the evidence per lr (`lr_brackets`). Pure
orchestration: the caller supplies the function that builds and scans one point, so
nothing here imports torch or prints.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import product
from typing import TYPE_CHECKING, Any

from actscan.diagnose.coord import coord_check
from actscan.diagnose.steps import STEP_CHECKS
from actscan.diagnose.thresholds import DEFAULT
from actscan.errors import UsageError
from actscan.models.arch import apply_overrides, build_config
from actscan.records import Finding, Severity, json_as
from actscan.report.codec import to_json_obj
from actscan.report.output import dumps
from actscan.report.report import SCHEMA_VERSION, Report
from actscan.settings import apply_ignores
from actscan.targets.classify import Kind, classify
from actscan.version import __version__

if TYPE_CHECKING:
    from actscan.diagnose.coord import CoordCheck
    from actscan.diagnose.thresholds import Thresholds

# Hugging Face config keys, in the order they are tried (GPT-2 style names second).
HF_DEPTH = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "encoder_layers")
# An encoder-decoder's other stack follows the swept depth (T5's num_decoder_layers,
# BART/Whisper's encoder_layers + decoder_layers), so both streams change together.
HF_DEPTH_COMPANIONS = ("num_decoder_layers", "encoder_layers", "decoder_layers")
HF_WIDTH = ("hidden_size", "n_embd", "d_model", "dim")
HF_HEADS = ("num_attention_heads", "n_head", "num_heads", "n_heads")
HF_FF = ("intermediate_size", "n_inner", "ffn_dim", "d_ff")


@dataclass(frozen=True)
class BaseConfig:
    """The architecture being swept, after the side's own --set overrides."""

    kind: str  # "builtin" | "hf"
    values: Mapping[str, Any]
    depth_key: str | None
    width_key: str | None
    heads_key: str | None
    ff_key: str | None


@dataclass(frozen=True)
class SweepPoint:
    """One model to build: a side (a/b) at one size, as --set overrides, and the learning
    rate its steps take (None: the settings' --lr)."""

    side: str
    depth: int | None
    width: int | None
    overrides: tuple[tuple[str, str], ...]
    lr: float | None = None

    @property
    def size(self) -> str:
        bits = []
        if self.depth is not None:
            bits.append(f"depth {self.depth}")
        if self.width is not None:
            bits.append(f"width {self.width}")
        if self.lr is not None:
            bits.append(f"lr {self.lr:g}")
        return " · ".join(bits)


@dataclass(frozen=True)
class SweepRow:
    side: str
    depth: int | None
    width: int | None
    overrides: tuple[tuple[str, str], ...] = field(metadata=json_as(mapping=True))
    final_rms: float | None
    growth: float | None  # last stream RMS ÷ first (the embedding as the blocks see it)
    growth_exponent: float | None  # p in RMS ∝ k^p
    gain_per_block: float | None  # γ
    grad_ratio: float | None  # grad RMS first ÷ last
    # findings per severity: info, warn, error
    counts: tuple[tuple[str, int], ...] = field(metadata=json_as(name="findings", mapping=True))
    worst_check: str | None
    worst_severity: str | None
    # in the JSON with the report's own envelope (Sweep.to_dict)
    report: Report = field(metadata=json_as(skip=True))
    lr: float | None = None  # the row's learning rate (--lrs); None: the settings' --lr

    @property
    def size(self) -> str:
        return SweepPoint(self.side, self.depth, self.width, self.overrides, self.lr).size


@dataclass(frozen=True)
class LrPoint:
    """One learning rate of an lr sweep: whether its first steps look like a run that
    trained (no warn/error step finding) and the evidence either way."""

    lr: float
    trains: bool
    # "check severity: value (threshold)" of each warn/error step finding; empty: none
    evidence: tuple[str, ...]
    loss_first: float | None  # the loss at step 0 and after the last step
    loss_last: float | None


@dataclass(frozen=True)
class LrBracket:
    """The lr bracket of one side at one size: `safe` is the highest lr whose first steps,
    and those of every lower lr of the sweep, look like runs that trained (None: not
    even the lowest); `flagged` the lowest lr whose steps did not."""

    side: str
    depth: int | None
    width: int | None
    safe: float | None
    flagged: float | None
    points: tuple[LrPoint, ...]


def _evidence(report: Report) -> tuple[str, ...]:
    return tuple(
        f"{f.check} {f.severity.value}"
        + (f": {f.value:.3g}" if f.value is not None and math.isfinite(f.value) else "")
        + (f" (threshold {f.threshold:.3g})" if f.threshold is not None else "")
        for f in report.findings
        if f.check in STEP_CHECKS and f.severity.rank >= Severity.WARN.rank
    )


def lr_brackets(rows: Sequence[SweepRow]) -> tuple[LrBracket, ...]:
    """Per side and size, the lr bracket of rows that took optimizer steps at ≥ 2 lrs."""
    groups: dict[tuple[str, int | None, int | None], list[SweepRow]] = {}
    for r in rows:
        if r.lr is not None and r.report.dynamics is not None:
            groups.setdefault((r.side, r.depth, r.width), []).append(r)
    out = []
    for (side, depth, width), mine in groups.items():
        if len(mine) < 2:
            continue
        points = []
        for r in sorted(mine, key=lambda r: r.lr or 0.0):
            assert r.lr is not None and r.report.dynamics is not None
            losses = [st.loss for st in r.report.dynamics.steps]
            ev = _evidence(r.report)
            points.append(LrPoint(r.lr, not ev, ev, losses[0], losses[-1]))
        safe = flagged = None
        for pt in points:
            if not pt.trains:
                flagged = pt.lr
                break
            safe = pt.lr
        out.append(LrBracket(side, depth, width, safe, flagged, tuple(points)))
    return tuple(out)


@dataclass(frozen=True)
class Trend:
    """How one side's rows move across sizes (flat ≈ ×1 means the scheme transfers)."""

    side: str
    growth_first: float | None
    growth_last: float | None
    growth_spread: float | None  # max ÷ min of growth over the rows
    final_rms_spread: float | None  # max ÷ min of final stream RMS


@dataclass(frozen=True)
class Sweep:
    target: str
    labels: tuple[tuple[str, str], ...]  # (side, label)
    depths: tuple[int, ...]
    widths: tuple[int, ...]
    depth_key: str | None
    width_key: str | None
    rows: tuple[SweepRow, ...]
    notes: tuple[str, ...] = ()
    # The μP coordinate check: a width sweep whose rows took optimizer steps (--steps N).
    coord: CoordCheck | None = None
    lrs: tuple[float, ...] = ()  # the --lrs axis
    # the lr bracket per side and size (--lrs with --steps N)
    brackets: tuple[LrBracket, ...] = ()

    @property
    def findings(self) -> tuple[Finding, ...]:
        """Findings about the sweep as a whole (coord-check), beyond each row's own."""
        return self.coord.findings if self.coord is not None else ()

    @property
    def sides(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(r.side for r in self.rows))

    def trends(self) -> tuple[Trend, ...]:
        return tuple(trend(self.rows, s) for s in self.sides)

    def to_dict(self) -> dict[str, Any]:
        """The `--json` document of `actscan sweep` (docs/interface-extensions.md)."""
        return {
            "schema_version": SCHEMA_VERSION,
            "kind": "sweep",
            "tool": {"name": "actscan", "version": __version__},
            "target": self.target,
            "labels": dict(self.labels),
            "axes": {"depth": list(self.depths) or None, "width": list(self.widths) or None},
            "keys": {"depth": self.depth_key, "width": self.width_key},
            "rows": [{**to_json_obj(r), "report": r.report.to_dict()} for r in self.rows],
            "trends": to_json_obj(self.trends()),
            "notes": list(self.notes),
            "coord": to_json_obj(self.coord),
            "lrs": list(self.lrs) or None,
            "lr_brackets": to_json_obj(self.brackets),
        }

    def to_json(self, indent: int | None = 2) -> str:
        return dumps(self.to_dict(), indent=indent)


# -- planning -------------------------------------------------------------------------------
def parse_sizes(text: str | None, option: str) -> tuple[int, ...]:
    """ "6,12,24" → (6, 12, 24); positive ints, no repeats."""
    if text is None:
        return ()
    try:
        sizes = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise UsageError(f"{option} expects comma-separated ints, got '{text}'") from None
    if not sizes or any(s < 1 for s in sizes):
        raise UsageError(f"{option} expects positive ints, got '{text}'")
    if len(set(sizes)) != len(sizes):
        raise UsageError(f"{option} lists a size twice: '{text}'")
    return sizes


def parse_lrs(text: str | None) -> tuple[float, ...]:
    """ "1e-4,3e-4,1e-3" → (1e-4, 3e-4, 1e-3), ascending; positive, no repeats."""
    if text is None:
        return ()
    try:
        lrs = tuple(float(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise UsageError(f"--lrs expects comma-separated numbers, got '{text}'") from None
    if not lrs or any(not (math.isfinite(x) and x > 0) for x in lrs):
        raise UsageError(f"--lrs expects positive learning rates, got '{text}'")
    if len(set(lrs)) != len(lrs):
        raise UsageError(f"--lrs lists a learning rate twice: '{text}'")
    return tuple(sorted(lrs))


def _first_key(values: Mapping[str, Any], keys: Sequence[str]) -> str | None:
    return next((k for k in keys if k in values), None)


def base_config(target: str, overrides: Mapping[str, str], flag: str = "--set") -> BaseConfig:
    """Read TARGET's architecture (a config file or a shipped config name) without
    building it: a sweep rebuilds it at every size, at initialization."""

    what = classify(target)
    if what.kind is Kind.CALLABLE:
        raise UsageError(
            f"sweep needs a config to rebuild at each size, not a module:callable ({target})"
        )
    path = what.path
    assert path is not None  # every kind but CALLABLE names a path
    if what.kind is Kind.FOLDER:
        raise UsageError(
            f"sweep builds models at initialization from a config: pass {path / 'config.json'}"
        )
    if not what.is_config:
        raise UsageError(
            f"sweep builds models at initialization from a config (.yaml/.toml/.json), "
            f"not {path.name}"
        )
    data = what.config_dict()
    if what.kind is Kind.BUILTIN_CONFIG:
        cfg = build_config(data, str(path))
        if overrides:
            cfg = apply_overrides(cfg, dict(overrides), flag)
        return BaseConfig("builtin", cfg.to_dict(), "n_layers", "d_model", "n_heads", "d_ff")
    values = {**data, **overrides}
    return BaseConfig(
        "hf",
        values,
        _first_key(values, HF_DEPTH),
        _first_key(values, HF_WIDTH),
        _first_key(values, HF_HEADS),
        _first_key(values, HF_FF),
    )


def size_overrides(base: BaseConfig, depth: int | None, width: int | None) -> dict[str, str]:
    """--set values that give `base` this depth and width.

    Width keeps the head count dividing d_model (largest common divisor with the old
    count), scales an explicit MLP width with d_model (the default 4·d follows by
    itself), and keeps an explicit head_dim / KV-head count consistent (HF configs).
    """
    out: dict[str, str] = {}
    v = base.values
    if depth is not None:
        if base.depth_key is None:
            raise UsageError(f"--depth: no depth key in the config (tried {', '.join(HF_DEPTH)})")
        out[base.depth_key] = str(depth)
        if base.kind == "hf":
            for key in HF_DEPTH_COMPANIONS:
                if isinstance(v.get(key), int) and key != base.depth_key:
                    out[key] = str(depth)
    if width is None:
        return out
    if base.width_key is None:
        raise UsageError(f"--width: no width key in the config (tried {', '.join(HF_WIDTH)})")
    old_width = int(v[base.width_key])
    out[base.width_key] = str(width)
    heads = None
    if base.heads_key is not None and v.get(base.heads_key):
        heads = math.gcd(width, int(v[base.heads_key]))
        if heads != int(v[base.heads_key]):
            out[base.heads_key] = str(heads)
    if base.ff_key is not None and v.get(base.ff_key):
        out[base.ff_key] = str(max(1, round(int(v[base.ff_key]) * width / old_width)))
    if base.kind == "hf" and heads is not None:
        if v.get("num_key_value_heads"):
            out["num_key_value_heads"] = str(math.gcd(heads, int(v["num_key_value_heads"])))
        if v.get("head_dim"):
            out["head_dim"] = str(width // heads)
    return out


def size_notes(base: BaseConfig, widths: Sequence[int]) -> tuple[str, ...]:
    """What the width overrides changed beyond the width itself, said once."""
    if not widths or base.heads_key is None or not base.values.get(base.heads_key):
        return ()
    heads = int(base.values[base.heads_key])
    odd = [w for w in widths if w % heads]
    if not odd:
        return ()
    return (
        f"{base.heads_key} {heads} does not divide width {', '.join(map(str, odd))}: "
        "lowered to the largest common divisor there",
    )


def plan(
    bases: Sequence[tuple[str, BaseConfig, Mapping[str, str]]],
    depths: Sequence[int],
    widths: Sequence[int],
    lrs: Sequence[float] = (),
) -> tuple[SweepPoint, ...]:
    """Every side at every size and lr (the grid when several axes are given), side by
    side.

    bases: (side, its base config, its own --set overrides).
    """
    if not depths and not widths and not lrs:
        raise UsageError(
            "sweep needs --depth, --width and/or --lrs, e.g. --depth 6,12,24,48 or "
            "--lrs 1e-4,1e-3,1e-2 --steps 10"
        )
    no_size: list[int | None] = [None]
    no_lr: list[float | None] = [None]
    sizes = list(product(depths or no_size, widths or no_size))
    points = []
    for side, base, own in bases:  # side-major: each side's rows read down as a trend
        for depth, width in sizes:
            merged = {**own, **size_overrides(base, depth, width)}
            for lr in lrs or no_lr:
                points.append(SweepPoint(side, depth, width, tuple(merged.items()), lr))
    return tuple(points)


# -- running --------------------------------------------------------------------------------
def row(point: SweepPoint, report: Report) -> SweepRow:
    s = report.summary
    counts = tuple(
        (sev.value, sum(1 for f in report.findings if f.severity is sev)) for sev in Severity
    )
    worst = max(report.findings, key=lambda f: f.severity.rank, default=None)
    final = next((p.rms for p in reversed(report.stream) if p.rms is not None), None)
    return SweepRow(
        side=point.side,
        depth=point.depth,
        width=point.width,
        overrides=point.overrides,
        final_rms=final,
        growth=s.growth,
        growth_exponent=s.growth_exponent,
        gain_per_block=s.gain_per_block,
        grad_ratio=s.grad_ratio,
        counts=counts,
        worst_check=worst.check if worst else None,
        worst_severity=worst.severity.value if worst else None,
        report=report,
        lr=point.lr,
    )


def run_sweep(
    target: str,
    points: Sequence[SweepPoint],
    scan_point: Callable[[SweepPoint], Report],
    *,
    labels: Sequence[tuple[str, str]],
    depths: Sequence[int] = (),
    widths: Sequence[int] = (),
    keys: tuple[str | None, str | None] = (None, None),
    notes: Sequence[str] = (),
    thresholds: Thresholds | None = None,
    ignores: Sequence[Any] = (),
) -> Sweep:
    """Scan every point in order (the caller's `scan_point` builds and measures one).

    A width sweep whose rows took steps also gets the coordinate check (`coord`), judged
    with `thresholds` (default: the shipped ones); `ignores` (settings.Ignore) drop its
    findings as they drop a report's."""
    rows = tuple(row(p, scan_point(p)) for p in points)
    lrs = tuple(dict.fromkeys(p.lr for p in points if p.lr is not None))
    coord = None
    if widths and len(lrs) < 2:  # the coordinate check compares widths at one lr
        coord = coord_check(
            [(r.side, r.depth, r.width, r.report) for r in rows if r.width is not None],
            thresholds or DEFAULT,
            labels=dict(labels),
        )
        if coord is not None and ignores:
            coord = replace(coord, findings=apply_ignores(coord.findings, ignores)[0])
    return Sweep(
        target=target,
        labels=tuple(labels),
        depths=tuple(depths),
        widths=tuple(widths),
        depth_key=keys[0],
        width_key=keys[1],
        rows=rows,
        notes=tuple(notes),
        coord=coord,
        lrs=lrs,
        brackets=lr_brackets(rows),
    )


def _spread(values: Sequence[float | None]) -> float | None:
    vals = [v for v in values if isinstance(v, float) and math.isfinite(v) and v > 0]
    return max(vals) / min(vals) if len(vals) >= 2 else None


def trend(rows: Sequence[SweepRow], side: str) -> Trend:
    mine = [r for r in rows if r.side == side]
    growth = [r.growth for r in mine]
    return Trend(
        side=side,
        growth_first=growth[0] if growth else None,
        growth_last=growth[-1] if growth else None,
        growth_spread=_spread(growth),
        final_rms_spread=_spread([r.final_rms for r in mine]),
    )
