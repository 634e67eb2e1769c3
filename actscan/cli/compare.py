"""`actscan compare A [B]`: two models, init schemes or precisions, side by side."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Annotated

import typer

from actscan.cli import options as c
from actscan.cli.app import app
from actscan.cli.sides import check_precision, side_a, side_b
from actscan.settings import Settings

if TYPE_CHECKING:
    from actscan.api import TargetSpec
    from actscan.cli.sides import Side
    from actscan.compare.pairs import Comparison
    from actscan.report.report import Report
    from actscan.run import CheckRunner


@app.command("compare")
@c.handle_errors
@c.setting_options("compare")
def compare(
    ctx: typer.Context,
    a: Annotated[str, typer.Argument(help="Target A (any TARGET profile accepts).")],
    settings: Settings,
    b: Annotated[
        str | None, typer.Argument(help="Target B (default: A, changed by the --vs-* options).")
    ] = None,
    config: c.ConfigOpt = None,
    vs_config: c.VsConfig = None,
    init: c.Init = None,
    vs_init: c.VsInit = None,
    set_: c.SetOpt = None,
    vs_set: c.VsSet = None,
    allow_nonfinite: c.AllowNonfinite = False,
    at_init: c.AtInit = None,
    input_file: c.InputFile = None,
    input_shape: c.InputShape = None,
    vs_dtype: c.VsDType = None,
    vs_amp: c.VsAmp = None,
    json_out: c.JsonOut = None,
    fmt: c.Format = c.FormatOpt.table,
    output: c.Output = None,
    quiet: c.Quiet = False,
    all_modules: Annotated[
        bool,
        c.option(
            "--all", help="Every matched layer (and every layer's divergence).", panel="Output"
        ),
    ] = False,
    plot: c.Plot = None,
) -> None:
    """Compare two models, init schemes or precisions block by block (ratios are B ÷ A).

    Both sides run on identical inputs and seeds; exit 1 if either has a finding ≥ --fail-on.

    [bold]Examples[/bold]

      actscan compare gpt-48-naive gpt-48-scaled
      actscan compare gpt-48-naive --vs-init fan-in --vs-set branch_scale=depth
      actscan compare gpt2-124m --dtype fp32 --vs-dtype bf16
      actscan compare model.safetensors --vs-amp bf16 --json compare.json
    """
    c.refuse_distributed("compare")
    if b is None and not (vs_init or vs_set or vs_dtype or vs_amp or vs_config):
        raise c.fail(
            "nothing to compare: give a second TARGET or a --vs-init/--vs-set/--vs-dtype/"
            "--vs-amp option"
        )
    a_side = side_a(a, config, init, set_, settings)
    b_side = side_b(
        a_side, target=b, config=vs_config, init=vs_init, sets=vs_set, dtype=vs_dtype, amp=vs_amp
    )
    for s in (a_side, b_side):
        check_precision(s)
    c.check_outputs(fmt, output, json_out, plot)  # fail now, not after a long scan
    same_weights = (b_side.target, b_side.config, b_side.init, b_side.sets) == (
        a_side.target,
        a_side.config,
        a_side.init,
        a_side.sets,
    )
    shape = c.parse_shape(input_shape)
    spec_a, spec_b = (
        s.spec(
            input_file=input_file,
            input_shape=shape,
            allow_nonfinite=allow_nonfinite,
            at_init=at_init,
        )
        for s in (a_side, b_side)
    )

    from actscan.api import Wiring

    ra, rb, cmp = _run_sides(
        (spec_a, a_side),
        (spec_b, b_side),
        settings,
        checks=Wiring.of(ctx.obj).checks,
        same_weights=same_weights,
        vs_set=vs_set,
        all_modules=all_modules,
        quiet=quiet,
    )
    if plot is not None:
        _plot(cmp, ra, rb, plot)

    from actscan.render.compare import render_comparison

    c.emit(
        [ra, rb],
        fmt=fmt,
        output=output,
        json_path=json_out,
        fail_on=settings.fail_on,
        render=lambda con: render_comparison(cmp, con, quiet=quiet, all_layers=all_modules),
        quiet=quiet,
        json_text=cmp.to_json,
    )
    raise typer.Exit(c.gate_exit(ra.findings + rb.findings, settings.fail_on))


def _plot(cmp: Comparison, ra: Report, rb: Report, plot: str) -> None:
    """Both sides' stream RMS against k in one figure."""
    from actscan.render.plot import Series, plot_streams

    series = [
        Series(f"{side}: {label}", tuple(p.k for p in r.stream), tuple(p.rms for p in r.stream))
        for side, label, r in (("A", cmp.label_a, ra), ("B", cmp.label_b, rb))
    ]
    plot_streams(series, plot, title="Residual stream RMS vs k")


def _run_sides(
    a: tuple[TargetSpec, Side],
    b: tuple[TargetSpec, Side],
    settings: Settings,
    *,
    checks: CheckRunner | None,
    same_weights: bool,
    vs_set: list[str] | None,
    all_modules: bool,
    quiet: bool,
) -> tuple[Report, Report, Comparison]:
    """Both sides' reports on identical inputs, and their comparison (with the divergence
    pass when they are the same weights in two precisions)."""
    (spec_a, a_side), (spec_b, b_side) = a, b
    from actscan.api import precision_divergence_of, scan_target
    from actscan.compare.pairs import compare_reports

    with c.ProgressSink(enabled=not quiet) as progress:
        ra, rb = (
            scan_target(spec, s.settings(settings), progress=progress, checks=checks).report
            for spec, s in ((spec_a, a_side), (spec_b, b_side))
        )
        div = None
        precision_differs = (ra.run.dtype, ra.run.amp) != (rb.run.dtype, rb.run.amp)
        known = {"fp32", "bf16", "fp16"}
        if same_weights and precision_differs and {ra.run.dtype, rb.run.dtype} <= known:
            progress.stage("precision divergence")
            div = precision_divergence_of(
                spec_a,
                settings,
                ra,
                rb,
                scope="all" if all_modules else "stream+branches",
            )
    cmp = compare_reports(
        ra,
        rb,
        label_a=a_side.label(),
        label_b=b_side.label_vs(a_side, vs_set),
        divergence=div,
    )
    if precision_differs and not same_weights:
        cmp = replace(
            cmp,
            notes=(
                *cmp.notes,
                "the sides differ in weights as well as precision: no divergence pass "
                "(compare one model: --dtype X --vs-dtype Y)",
            ),
        )
    return ra, rb, cmp
