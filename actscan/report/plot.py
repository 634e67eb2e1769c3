"""`--plot PATH`: stream RMS against k, one line per side/size. Optional (`actscan[plot]`).

matplotlib is imported only here and only when asked for; the object-oriented API
(Figure + Agg canvas) leaves pyplot's global state and the user's backend alone.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from actscan.errors import ActscanError, UsageError
from actscan.report.output import write_atomic


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
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ActscanError("--plot needs matplotlib: pip install 'actscan[plot]'") from None
    out = Path(path)
    fmt = out.suffix.lower().lstrip(".") or "png"
    if fmt not in ("png", "svg", "pdf"):
        raise UsageError(f"--plot: unsupported image type '.{fmt}' (use .png, .svg or .pdf)")
    fig = Figure(figsize=(7.5, 4.5), dpi=120, layout="constrained")
    FigureCanvasAgg(fig)
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
    buf = io.BytesIO()
    fig.savefig(buf, format=fmt)
    write_atomic(out, buf.getvalue())  # a reader never sees half an image
    return out


def _viridis(t: float) -> tuple[float, float, float, float]:
    from matplotlib import colormaps

    return colormaps["viridis"](0.85 * min(max(t, 0.0), 1.0))
