"""`--plot PATH`: stream RMS against k, one line per side/size; a width sweep with steps
draws the coordinate check instead (mean |x_t| vs width per t). Optional (`actscan[plot]`).

matplotlib is imported only here and only when asked for; the object-oriented API
(Figure + Agg canvas) leaves pyplot's global state and the user's backend alone.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from actscan.errors import ActscanError, UsageError
from actscan.report.output import write_atomic

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from actscan.diagnose.coord import CoordCurve


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
    ax = fig.add_subplot()
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
            [k for k, _ in pts], [v for _, v in pts], marker=".", markersize=3,
            linestyle=s.linestyle, color=color, label=s.label,
        )  # fmt: skip
    if values and max(values) / min(values) > 10:
        ax.set_yscale("log")
    ax.set_xlabel("k (residual additions)")
    ax.set_ylabel("stream RMS")
    if title:
        ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if series:
        ax.legend(fontsize="small")
    return _save(fig, out, fmt)


def check_plot(path: str | Path) -> str:
    """PATH's image format, once matplotlib imports and PATH's folder exists (a command
    calls this before its scans, so a bad --plot fails in a second, not after them)."""
    try:
        import matplotlib.figure  # noqa: F401
    except ImportError:
        raise ActscanError("--plot needs matplotlib: pip install 'actscan[plot]'") from None
    out = Path(path)
    fmt = out.suffix.lower().lstrip(".") or "png"
    if fmt not in ("png", "svg", "pdf"):
        raise UsageError(f"--plot: unsupported image type '.{fmt}' (use .png, .svg or .pdf)")
    if not out.absolute().parent.is_dir():
        raise UsageError(f"cannot write {path}: {out.parent} is not an existing folder")
    return fmt


def _figure(path: str | Path, size: tuple[float, float]) -> tuple[Figure, Path, str]:
    """A Figure on an Agg canvas (pyplot untouched), PATH and its image format."""
    fmt = check_plot(path)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    out = Path(path)
    fig = Figure(figsize=size, dpi=120, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, out, fmt


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
                    [w for w, _ in pts], [v for _, v in pts], marker="o", markersize=3,
                    linestyle="-" if c.side == sides[0] else "--",
                    color=GROUP_COLORS.get(c.group), label=c.group if len(sides) < 2
                    else f"{side}: {c.group}",
                )  # fmt: skip
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


def _viridis(t: float) -> tuple[float, float, float, float]:
    from matplotlib import colormaps

    return colormaps["viridis"](0.85 * min(max(t, 0.0), 1.0))
