"""`actscan profile TARGET`: measure one model, print tables and findings."""

from __future__ import annotations

import functools
import os
import sys
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer

from actscan.cli import options as c
from actscan.cli.app import app
from actscan.errors import UsageError
from actscan.settings import Settings

if TYPE_CHECKING:
    from actscan.api import TargetSpec
    from actscan.run import CheckRunner

Plot = Annotated[
    str | None,
    c.option(
        "--plot",
        help="Draw stream RMS vs k, per-channel max |x| per stream point and attention "
        "entropy per layer × head to PATH (.png/.svg/.pdf; needs actscan[plot]).",
        panel="Output",
    ),
]
AllModules = Annotated[bool, c.option("--all", help="Table of every module.", panel="Output")]
ShowConfig = Annotated[
    bool,
    c.option("--show-config", help="Print the effective settings and exit.", panel="Output"),
]


@app.command("profile")
@c.handle_errors
@c.setting_options("profile")
def profile(
    ctx: typer.Context,
    target: Annotated[
        str,
        typer.Argument(
            help="model.safetensors, a Hugging Face folder, a config file (.yaml/.toml/.json), "
            "a shipped config name, or package.module:callable."
        ),
    ],
    settings: Settings,
    config: c.ConfigOpt = None,
    init: c.Init = None,
    set_: c.SetOpt = None,
    input_file: c.InputFile = None,
    input_shape: c.InputShape = None,
    allow_nonfinite: c.AllowNonfinite = False,
    at_init: c.AtInit = None,
    nproc: c.NProc = None,
    json_out: c.JsonOut = None,
    fmt: c.Format = c.FormatOpt.table,
    output: c.Output = None,
    quiet: c.Quiet = False,
    plot: Plot = None,
    all_modules: AllModules = False,
    show_config: ShowConfig = False,
) -> None:
    """Measure one forward+backward pass and report the scale of activations and gradients.

    [bold]Examples[/bold]

      actscan profile sample_models/healthy.safetensors
      actscan profile configs/gpt-48-naive.yaml --init fan-in --set branch_scale=depth
      actscan profile path/to/hf-model --dtype bf16 --json report.json
      actscan profile mypkg.models:build --input-shape 8,128 --fail-on warn
      actscan profile configs/llama-12.toml --nproc 4   (or: torchrun … -m actscan profile …)
      actscan profile path/to/hf-model --input text.txt --plot profile.png
    """
    from actscan.distributed.launch import launch, launched

    if show_config:
        _print_settings(settings)
        raise typer.Exit(c.EXIT_OK)
    if not launched() and nproc is not None:
        raise typer.Exit(launch(nproc, sys.argv[1:]))
    try:
        shape = c.parse_shape(input_shape)
    except UsageError as err:
        raise c.fail(str(err), rank0=True) from None
    from actscan.api import TargetSpec, Wiring

    spec = TargetSpec(
        target=target,
        config=config,
        init=init,
        overrides=tuple(set_ or ()),
        input_file=input_file,
        input_shape=shape,
        allow_nonfinite=allow_nonfinite,
        at_init=at_init,
    )
    body = functools.partial(
        _profile,
        spec,
        settings,
        checks=Wiring.of(ctx.obj).checks,  # tests plant a check runner here
        plot=plot,
        json_out=json_out,
        fmt=fmt,
        output=output,
        quiet=quiet,
        all_modules=all_modules,
    )
    if not launched():
        body()
        return
    world = int(os.environ["WORLD_SIZE"])
    if nproc is not None and nproc != world:
        raise c.fail(f"--nproc {nproc} under a launcher that started {world} processes", rank0=True)
    from actscan.distributed.runtime import run_ranked

    code = run_ranked(body, settings.device, settings.dist_timeout, errors=c.handle_errors)
    raise typer.Exit(code)


def _profile(
    spec: TargetSpec,
    settings: Settings,
    *,
    checks: CheckRunner | None,
    plot: str | None,
    json_out: str | None,
    fmt: c.FormatOpt,
    output: str | None,
    quiet: bool,
    all_modules: bool,
) -> NoReturn:
    """The command itself, in one process or as one rank (only rank 0 writes); ends with
    the exit code."""
    from actscan.distributed.launch import launched

    main = not launched() or os.environ.get("RANK", "0") == "0"
    if settings.dtype not in (None, "fp32") and settings.amp is not None:
        raise c.fail("--dtype and --amp together: autocast runs fp32 weights (drop --dtype)")
    c.check_outputs(fmt, output, json_out, plot)  # fail now, not after a long scan
    from actscan.api import scan_target

    with c.ProgressSink(enabled=not quiet and main) as progress:
        scanned = scan_target(spec, settings, progress=progress, checks=checks)
    from actscan.render.terminal import render_report

    report = scanned.report
    if not main:  # every rank holds the merged report; rank 0 writes it
        raise typer.Exit(c.gate_exit(report.findings, settings.fail_on))
    if plot is not None:
        from actscan.render.plot import plot_profile, profile_figure

        plot_profile(profile_figure(report), plot)
    c.emit(
        [report],
        fmt=fmt,
        output=output,
        json_path=json_out,
        fail_on=settings.fail_on,
        render=lambda con: render_report(
            report, con, all_modules=all_modules, quiet=quiet, ignored=scanned.ignored
        ),
        quiet=quiet,
    )
    raise typer.Exit(c.gate_exit(report.findings, settings.fail_on))


def _print_settings(settings: Settings) -> None:
    """One row per setting and per threshold (defaults included), with where it came from."""
    from rich.table import Table

    console = c.make_console()
    path = settings.project
    console.print(f"project config: {path if path is not None else 'none found'}")

    def where(src: str) -> str:  # the file's name: its full path is on the line above
        return path.name if path is not None and src == str(path) else src

    table = Table(title="Effective settings", title_justify="left")
    table.add_column("setting")
    table.add_column("value")
    table.add_column("from")
    for key, value in settings.run_values().items():
        shown = "—" if value is None else str(value)
        table.add_row(key.replace("_", "-"), shown, where(settings.source(key)))
    for name, value in settings.threshold_set().as_dict().items():
        src = settings.source(f"thresholds.{name}") if name in settings.thresholds else "default"
        table.add_row(f"threshold {name}", f"{value:g}", where(src))
    console.print(table)
    for ig in settings.ignores:
        console.print(
            f"ignore {ig.check}" + (f" at /{ig.layers}/" if ig.layers else "") + f": {ig.reason}"
        )
