"""`actscan sweep TARGET --depth … --width …`: one row per size (mup's coordinate check)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Annotated

import typer

from actscan.cli import options as c
from actscan.cli.app import app
from actscan.cli.sides import check_precision, side_a, side_b
from actscan.settings import Settings

if TYPE_CHECKING:
    from actscan.compare.sweep import Sweep, SweepPoint
    from actscan.report.report import Report

Depth = Annotated[
    str | None, c.option("--depth", help="Blocks per model, e.g. 6,12,24,48.", panel="Target")
]
Width = Annotated[
    str | None,
    c.option("--width", help="Model width (d_model), e.g. 128,256,512.", panel="Target"),
]
Lrs = Annotated[
    str | None,
    c.option(
        "--lrs",
        help="Learning rates to take the --steps at, e.g. 1e-4,1e-3,1e-2,1e-1: reports the "
        "highest whose first steps look like runs that trained.",
        panel="Steps",
    ),
]


@app.command("sweep")
@c.handle_errors
@c.setting_options("sweep")
def sweep(
    ctx: typer.Context,
    target: Annotated[
        str, typer.Argument(help="A config file (built-in or Hugging Face) or a shipped name.")
    ],
    settings: Settings,
    depth: Depth = None,
    width: Width = None,
    lrs: Lrs = None,
    init: c.Init = None,
    vs_init: c.VsInit = None,
    set_: c.SetOpt = None,
    vs_set: c.VsSet = None,
    input_file: c.InputFile = None,
    vs_dtype: c.VsDType = None,
    vs_amp: c.VsAmp = None,
    json_out: c.JsonOut = None,
    fmt: c.Format = c.FormatOpt.table,
    output: c.Output = None,
    quiet: c.Quiet = False,
    plot: c.Plot = None,
) -> None:
    """Measure TARGET at several depths, widths and/or learning rates.

    One row per size (a grid if several axes are given): flat rows mean it transfers
    (mup's coordinate check as a table). With --lrs and --steps N: the highest learning
    rate whose first N steps look like runs that trained, with the evidence per lr.

    A --vs-* option measures each size twice (A and B). Exit 1 if any row trips --fail-on.

    [bold]Examples[/bold]

      actscan sweep gpt-48-naive --depth 6,12,24,48
      actscan sweep gpt-48-naive --depth 6,12,24,48 --vs-set branch_scale=depth
      actscan sweep configs/gpt-12-preln.yaml --width 128,256,512,1024 --plot width.png
      actscan sweep gpt-12-preln --lrs 1e-4,1e-3,3e-3,1e-2,3e-2,1e-1 --steps 10
    """
    c.refuse_distributed("sweep")
    from actscan.api import Wiring, scan_target
    from actscan.compare.sweep import (
        base_config,
        parse_lrs,
        parse_sizes,
        plan,
        run_sweep,
        size_notes,
    )
    from actscan.errors import UsageError
    from actscan.models.arch import parse_set

    depths, widths = parse_sizes(depth, "--depth"), parse_sizes(width, "--width")
    lr_axis = parse_lrs(lrs)
    if lr_axis and settings.steps < 1:
        raise UsageError("--lrs judges the first optimizer steps: add --steps N (e.g. 10)")
    a_side = side_a(target, None, init, set_, settings)
    sides = [a_side]
    if vs_init or vs_set or vs_dtype or vs_amp:
        sides.append(
            side_b(
                a_side,
                target=None,
                config=None,
                init=vs_init,
                sets=vs_set,
                dtype=vs_dtype,
                amp=vs_amp,
            )
        )
    for s in sides:
        check_precision(s)
    c.check_outputs(fmt, output, json_out, plot)  # fail now, not after a long scan
    sets = {s.tag: parse_set(list(s.sets), s.flag("set")) for s in sides}
    bases = [(s.tag, base_config(target, sets[s.tag], s.flag("set")), sets[s.tag]) for s in sides]
    points = plan(bases, depths, widths, lr_axis)
    by_tag = {s.tag: s for s in sides}
    base_a = bases[0][1]
    notes = size_notes(base_a, widths)

    with c.ProgressSink(enabled=not quiet) as progress:

        def scan_point(point: SweepPoint) -> Report:
            side = by_tag[point.side]
            sized = replace(side, sets=tuple(f"{k}={v}" for k, v in point.overrides))
            progress.stage(f"{point.side.upper()} {point.size}")
            spec = sized.spec(input_file=input_file)
            run = side.settings(settings)
            if point.lr is not None:
                run = replace(run, lr=point.lr)
            checks = Wiring.of(ctx.obj).checks
            return scan_target(spec, run, checks=checks).report

        result = run_sweep(
            target,
            points,
            scan_point,
            labels=[
                (s.tag, s.label() if s.tag == "a" else s.label_vs(a_side, vs_set)) for s in sides
            ],
            depths=depths,
            widths=widths,
            keys=(base_a.depth_key, base_a.width_key),
            notes=notes,
            thresholds=settings.threshold_set(),
            ignores=settings.ignores,
        )

    if plot is not None:
        _plot(result, plot, target, two=len(sides) > 1)

    reports = _emit(
        result, target, settings, fmt=fmt, output=output, json_out=json_out, quiet=quiet
    )
    findings = [f for r in reports for f in r.findings] + list(result.findings)
    raise typer.Exit(c.gate_exit(findings, settings.fail_on))


def _plot(result: Sweep, plot: str, target: str, *, two: bool) -> None:
    """--plot: the coordinate check's curves when there is one, else each size's stream."""
    if result.coord is not None:
        from actscan.render.plot import plot_coord

        plot_coord(
            result.coord.curves,
            result.coord.widths,
            plot,
            labels={k: f"{k.upper()}" for k, _ in result.labels},
            title=f"Coordinate check: mean |x| vs width, {target}",
        )
        return
    from actscan.render.plot import Series, plot_streams

    sizes = list(dict.fromkeys((r.depth, r.width) for r in result.rows))
    plot_streams(
        [
            Series(
                (f"{r.side.upper()} " if two else "") + r.size,
                tuple(p.k for p in r.report.stream),
                tuple(p.rms for p in r.report.stream),
                linestyle="-" if r.side == "a" else "--",
                shade=sizes.index((r.depth, r.width)) / max(len(sizes) - 1, 1),
            )
            for r in result.rows
        ],
        plot,
        title=f"Residual stream RMS vs k: {target}",
    )


def _emit(
    result: Sweep,
    target: str,
    settings: Settings,
    *,
    fmt: c.FormatOpt,
    output: str | None,
    json_out: str | None,
    quiet: bool,
) -> list[Report]:
    """Show the sweep in the chosen format (and its JSON); gives its rows' reports."""
    from actscan.render.compare import render_sweep
    from actscan.render.formats import coord_markdown, to_junit, to_markdown

    reports = [r.report for r in result.rows]
    gate = settings.fail_on
    cc = result.coord

    def markdown() -> str:
        parts = [to_markdown(r, fail_on=gate) for r in reports]
        if cc is not None:
            parts.append(coord_markdown(cc, result.labels, fail_on=gate))
        return "\n\n".join(parts)

    c.emit(
        reports,
        fmt=fmt,
        output=output,
        json_path=json_out,
        fail_on=gate,
        render=lambda con: render_sweep(result, con, quiet=quiet),
        quiet=quiet,
        json_text=result.to_json,
        markdown_text=markdown,
        junit_text=lambda: to_junit(
            reports, fail_on=gate, coord=(target, cc.findings) if cc is not None else None
        ),
    )
    return reports
