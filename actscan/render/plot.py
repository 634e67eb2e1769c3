"""`--plot PATH`: stream RMS against k, one line per side/size (compare, sweep); a width
sweep with steps draws the coordinate check instead (mean |x_t| vs width per t); `profile
--plot` draws three panels. Optional (`actscan[plot]`).

matplotlib is imported only here and only when asked for; the object-oriented API
(Figure + Agg canvas) leaves pyplot's global state and the user's backend alone.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from actscan.errors import ActscanError, UsageError
from actscan.report.output import check_writable, write_atomic

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from actscan.diagnose.coord import CoordCurve
    from actscan.report.report import Report


@dataclass(frozen=True)
class Series:
    label: str
    ks: tuple[int, ...]
    rms: tuple[float | None, ...]
    linestyle: str = "-"  # one per side
    shade: float | None = None  # 0..1 along a colormap: one per size (None: default cycle)


def plot_streams(series: Sequence[Series], path: str | Path, *, title: str = "") -> Path:
    """Draw stream RMS vs k (log scale when the values span more than ×10) and write
    PATH atomically; the format follows the suffix (.png, .svg, .pdf)."""
    fig, out, fmt = _figure(path, (7.5, 4.5))
    _stream_axes(fig.add_subplot(), series, title)
    return _save(fig, out, fmt)


def _stream_axes(ax: Any, series: Sequence[Series], title: str, legend: bool = True) -> None:
    values: list[float] = []
    for s in series:
        pts = [
            (k, v)
            for k, v in zip(s.ks, s.rms, strict=True)
            if v is not None and math.isfinite(v) and v > 0
        ]
        if not pts:
            continue
        values += [v for _, v in pts]
        color = None if s.shade is None else _viridis(s.shade)
        ax.plot(
            [k for k, _ in pts],
            [v for _, v in pts],
            marker=".",
            markersize=3,
            linestyle=s.linestyle,
            color=color,
            label=s.label,
        )
    if values and max(values) / min(values) > 10:
        ax.set_yscale("log")
    ax.set_xlabel("k (residual additions)")
    ax.set_ylabel("stream RMS")
    if title:
        ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if series and legend:
        ax.legend(fontsize="small")


def check_plot(path: str | Path) -> str:
    """Fail before any work when PATH cannot be drawn: matplotlib missing, an image type
    it does not write, or a path `check_writable` refuses. Returns the format."""
    try:
        import matplotlib.backends.backend_agg
        import matplotlib.figure  # noqa: F401
    except ImportError:
        raise ActscanError("--plot needs matplotlib: pip install 'actscan[plot]'") from None
    out = Path(path)
    fmt = out.suffix.lower().lstrip(".") or "png"
    if fmt not in ("png", "svg", "pdf"):
        raise UsageError(f"--plot: unsupported image type '.{fmt}' (use .png, .svg or .pdf)")
    check_writable(path)
    return fmt


def _figure(path: str | Path, size: tuple[float, float]) -> tuple[Figure, Path, str]:
    """A Figure on an Agg canvas (pyplot untouched), PATH and its image format."""
    fmt = check_plot(path)
    return canvas(size), Path(path), fmt


def canvas(size: tuple[float, float]) -> Figure:
    """An empty Figure on its own Agg canvas (matplotlib must be importable)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, dpi=120, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Figure, out: Path, fmt: str) -> Path:
    buf = io.BytesIO()
    fig.savefig(buf, format=fmt)
    write_atomic(out, buf.getvalue())  # a reader never sees half an image
    return out


# μP's picture: one colour per module group, from the input side to the readout.
GROUP_COLORS = {
    "embedding": "#1b9e77",
    "early": "#7570b3",
    "mid": "#e7298a",
    "late": "#d95f02",
    "head": "#444444",
}


def plot_coord(
    curves: Sequence[CoordCurve],
    widths: Sequence[int],
    path: str | Path,
    *,
    labels: Mapping[str, str] | None = None,
    title: str = "",
) -> Path:
    """The coordinate check as Tensor Programs V draws it: one panel per step t, mean |x_t|
    against width on log–log axes, one line per module group (solid side A, dashed B; one
    figure row per depth when the sweep has several). Flat lines: the parametrization
    transfers. Writes PATH atomically."""
    steps = sorted({c.t for c in curves})
    depths = list(dict.fromkeys(c.depth for c in curves))
    sides = list(dict.fromkeys(c.side for c in curves))
    ncols, nrows = max(len(steps), 1), max(len(depths), 1)
    fig, out, fmt = _figure(path, (3.2 * ncols + 1.0, 3.0 * nrows + 0.6))
    axes = fig.subplots(nrows, ncols, squeeze=False, sharex=True, sharey=True)
    for r, depth in enumerate(depths):
        for col, t in enumerate(steps):
            ax = axes[r][col]
            for c in curves:
                if c.t != t or c.depth != depth:
                    continue
                pts = [
                    (w, v)
                    for w, v in zip(widths, c.abs_mean, strict=True)
                    if v is not None and math.isfinite(v) and v > 0
                ]
                if not pts:
                    continue
                side = (labels or {}).get(c.side, c.side.upper())
                ax.plot(
                    [w for w, _ in pts],
                    [v for _, v in pts],
                    marker="o",
                    markersize=3,
                    linestyle="-" if c.side == sides[0] else "--",
                    color=GROUP_COLORS.get(c.group),
                    label=c.group if len(sides) < 2 else f"{side}: {c.group}",
                )
            ax.set_xscale("log", base=2)
            ax.set_xticks(list(widths), [str(w) for w in widths])
            ax.minorticks_off()
            ax.set_yscale("log")
            ax.set_title(f"t = {t}" + (f" · depth {depth}" if depth is not None else ""))
            ax.grid(True, alpha=0.3)
            if r == nrows - 1:
                ax.set_xlabel("width")
            if col == 0:
                ax.set_ylabel("mean |x|")
    if curves:
        axes[0][-1].legend(fontsize="x-small")
    if title:
        fig.suptitle(title)
    return _save(fig, out, fmt)


# Columns of the channel heat map: wider streams are shown binned, each bin the max of its
# channels, so a single outlier channel stays one visible column (display only).
MAX_COLUMNS = 512
PROFILE_SIZE = (16.0, 4.8)  # inches
# Row labels of the heat maps: "x-small" (0.694 × matplotlib's default 10 pt), each given
# 1.3 × its size; the panels get at most this fraction of the figure's height (title,
# suptitle, tick labels and the x label take the rest).
LABEL_PT = 6.94
LABEL_LINE = 1.3
AXES_FRACTION = 0.72


def label_step(n_rows: int, height_in: float = PROFILE_SIZE[1]) -> int:
    """Label every n-th row of a heat map in a figure `height_in` inches tall: the
    smallest n whose labels fit the panel's height without overlapping."""
    fits = max(1, int(height_in * AXES_FRACTION * 72 / (LABEL_PT * LABEL_LINE)))
    return max(1, -(-n_rows // fits))


def row_ticks(
    names: Sequence[str], height_in: float = PROFILE_SIZE[1]
) -> tuple[list[int], list[str]]:
    """(row positions, their labels): every `label_step`-th row, from the first."""
    rows = list(range(0, len(names), label_step(len(names), height_in)))
    return rows, [names[i] for i in rows]


Heads = Sequence[tuple[str, Sequence[float | None]]]


@dataclass(frozen=True)
class ProfileFigure:
    """What `profile --plot` draws, as measured: the stream (one series), each stream
    point's per-channel max-abs (Report.channel_maxima: empty for a report read from
    JSON), and per attention layer its heads' normalised entropy (None: probes off or
    unavailable)."""

    stream: Series
    channel_maxima: Sequence[tuple[str, Sequence[float]]] = ()
    heads: Heads | None = None
    title: str = ""
    # `--formats`: per GEMM, each format's largest relative error over its operands
    lowprec: tuple[tuple[str, tuple[float | None, ...]], ...] = ()
    formats: tuple[str, ...] = ()


def profile_figure(report: Report) -> ProfileFigure:
    """The three panels' data, read off a report. Attention comes from the report's
    `attention` records (layer name, each head's normalised entropy) when the run has
    them; without, the panel says the probes were off or unavailable."""
    attention = getattr(report, "attention", None) or ()
    heads = [(a.name, [h.entropy for h in a.heads]) for a in attention] or None
    m = report.model
    records = getattr(report, "low_precision", None) or ()
    formats = tuple(dict.fromkeys(r.format for r in records))
    worst: dict[str, dict[str, float]] = {}
    for r in records:
        if r.error is not None:
            cell = worst.setdefault(r.gemm, {})
            cell[r.format] = max(cell.get(r.format, 0.0), r.error)
    lowprec = tuple((g, tuple(e.get(f) for f in formats)) for g, e in worst.items())
    return ProfileFigure(
        stream=Series(
            "stream", tuple(p.k for p in report.stream), tuple(p.rms for p in report.stream)
        ),
        channel_maxima=report.channel_maxima,
        heads=heads,
        title=f"{m.source} ({m.family}, {m.n_blocks} blocks, d={m.d_model})",
        lowprec=lowprec,
        formats=formats,
    )


def plot_profile(fig_data: ProfileFigure, path: str | Path) -> Path:
    """One figure, three panels: stream RMS vs k; a stream point × channel heat map of
    per-channel max |x| (log colour); a layer × head heat map of attention entropy."""
    fig, out, fmt = _figure(path, PROFILE_SIZE)
    draw_profile(fig, fig_data)
    return _save(fig, out, fmt)


def draw_profile(fig: Figure, fig_data: ProfileFigure) -> None:
    """`plot_profile`'s three panels, drawn on `fig`."""
    from matplotlib.colors import LogNorm, Normalize

    if fig_data.lowprec:  # `--formats`: a fourth panel
        a_rms, a_ch, a_head, a_lp = fig.subplots(1, 4, width_ratios=(1.0, 1.4, 1.0, 0.6))
        _lowprec_axes(fig, a_lp, fig_data)
    else:
        a_rms, a_ch, a_head = fig.subplots(1, 3, width_ratios=(1.0, 1.4, 1.0))
    _stream_axes(a_rms, [fig_data.stream], "Residual stream RMS vs k", legend=False)

    rows = [tuple(v for v in vals) for _, vals in fig_data.channel_maxima]
    width = max((len(r) for r in rows), default=0)
    if rows and all(len(r) == width for r in rows) and width:
        step = -(-width // MAX_COLUMNS)
        grid = [[max(r[j : j + step]) for j in range(0, width, step)] for r in rows]
        pos = [v for r in grid for v in r if math.isfinite(v) and v > 0]
        lo, hi = (min(pos), max(pos)) if pos else (1e-3, 1.0)
        norm = LogNorm(vmin=lo, vmax=hi) if hi > lo else Normalize(vmin=0, vmax=hi or 1)
        im = a_ch.imshow(
            [[v if math.isfinite(v) and v > 0 else float("nan") for v in r] for r in grid],
            aspect="auto",
            interpolation="nearest",
            cmap="magma",
            norm=norm,
            extent=(-0.5, width - 0.5, len(rows) - 0.5, -0.5),
        )
        fig.colorbar(im, ax=a_ch, label="max |x| per channel")
        a_ch.set_yticks(*row_ticks([n for n, _ in fig_data.channel_maxima]), fontsize=LABEL_PT)
        a_ch.set_xlabel("channel" + (f" (max over {step} per column)" if step > 1 else ""))
    else:
        _empty(a_ch, "per-channel maxima not available\n(not recorded, or a report read from JSON)")
    a_ch.set_title("Per-channel max |x| at each stream point")

    heads = [(n, list(e)) for n, e in fig_data.heads or ()]
    n_heads = max((len(e) for _, e in heads), default=0)
    if heads and n_heads:
        grid = [
            [float("nan") if v is None else v for v in e] + [float("nan")] * (n_heads - len(e))
            for _, e in heads
        ]
        im = a_head.imshow(
            grid, aspect="auto", interpolation="nearest", cmap="viridis", vmin=0.0, vmax=1.0
        )
        fig.colorbar(im, ax=a_head, label="entropy / ln(keys)")
        a_head.set_yticks(*row_ticks([n for n, _ in heads]), fontsize=LABEL_PT)
        a_head.set_xlabel("head")
    else:
        _empty(a_head, "attention probes off/unavailable")
    a_head.set_title("Attention entropy, layer × head")
    if fig_data.title:
        fig.suptitle(fig_data.title)


def _lowprec_axes(fig: Figure, ax: Any, fig_data: ProfileFigure) -> None:
    """GEMM × format heat map of log10 of the largest relative error ‖Q(x)−x‖²/‖x‖²."""
    grid = [
        [math.log10(v) if v is not None and v > 0 else float("nan") for v in errs]
        for _, errs in fig_data.lowprec
    ]
    im = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="inferno")
    fig.colorbar(im, ax=ax, label="log10 relative error")
    ax.set_yticks(*row_ticks([g for g, _ in fig_data.lowprec]), fontsize=LABEL_PT)
    ax.set_xticks(range(len(fig_data.formats)), fig_data.formats)
    ax.set_title("Low precision: worst operand")


def _empty(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.4")
    ax.set_xticks([])
    ax.set_yticks([])


def _viridis(t: float) -> tuple[float, float, float, float]:
    from matplotlib import colormaps

    return colormaps["viridis"](0.85 * min(max(t, 0.0), 1.0))
