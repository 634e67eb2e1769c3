"""`actscan profile TARGET`: measure one model, print tables and findings."""

from __future__ import annotations

import functools
import os
import sys
from typing import TYPE_CHECKING, Annotated, Any

import typer

from actscan.cli import app
from actscan.cli import options as c

if TYPE_CHECKING:
    from actscan.run import CheckRunner
    from actscan.settings import Settings


@app.command("profile")
@c.handle_errors
def profile(
    ctx: typer.Context,
    target: Annotated[
        str,
        typer.Argument(
            help="model.safetensors, a Hugging Face folder, a config file (.yaml/.toml/.json), "
            "a shipped config name, or package.module:callable."
        ),
    ],
    config: c.ConfigOpt = None,
    dtype: c.DType = None,
    amp: c.Amp = None,
    init: c.Init = None,
    set_: c.SetOpt = None,
    batch: c.BatchOpt = None,
    seq_len: c.SeqLen = None,
    batches: c.Batches = None,
    seed: c.Seed = None,
    input_file: c.InputFile = None,
    device: c.Device = None,
    modules: c.Modules = None,
    no_backward: c.NoBackward = False,
    dropout: c.DropoutFlag = False,
    steps: c.StepsOpt = None,
    lr: c.LrOpt = None,
    optimizer: c.OptimizerOpt = None,
    eps: c.EpsOpt = None,
    weight_decay: c.WeightDecayOpt = None,
    warmup: c.WarmupOpt = None,
    no_attention: c.NoAttention = False,
    json_out: c.JsonOut = None,
    fmt: c.Format = c.FormatOpt.table,
    output: c.Output = None,
    fail_on: c.FailOn = None,
    input_shape: c.InputShape = None,
    threshold: c.ThresholdOpt = None,
    quiet: c.Quiet = False,
    allow_nonfinite: c.AllowNonfinite = False,
    at_init: c.AtInit = None,
    plot: Annotated[
        str | None,
        typer.Option(
            "--plot",
            help="Draw stream RMS vs k, per-channel max |x| per stream point and attention "
            "entropy per layer × head to PATH (.png/.svg/.pdf; needs actscan[plot]).",
        ),
    ] = None,
    all_modules: Annotated[bool, typer.Option("--all", help="Table of every module.")] = False,
    show_config: Annotated[
        bool, typer.Option("--show-config", help="Print the effective settings and exit.")
    ] = False,
    nproc: c.NProc = None,
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

    if not launched() and nproc is not None:
        raise typer.Exit(launch(nproc, sys.argv[1:]))
    from actscan.api import Wiring

    checks = Wiring.of(ctx.obj).checks  # tests plant a check runner here
    body = functools.partial(
        _profile, target, checks=checks, config=config, dtype=dtype, amp=amp, init=init,
        set_=set_, batch=batch, seq_len=seq_len, batches=batches, seed=seed, input_file=input_file,
        device=device, modules=modules, no_backward=no_backward, dropout=dropout,
        steps=steps, lr=lr, optimizer=optimizer, eps=eps, weight_decay=weight_decay,
        warmup=warmup, no_attention=no_attention, plot=plot, json_out=json_out, fmt=fmt,
        output=output,
        fail_on=fail_on,
        input_shape=input_shape, threshold=threshold, quiet=quiet,
        allow_nonfinite=allow_nonfinite, at_init=at_init, all_modules=all_modules,
        show_config=show_config,
    )  # fmt: skip
    if not launched():
        body()
        return
    world = int(os.environ["WORLD_SIZE"])
    if nproc is not None and nproc != world:
        raise _fail_rank0(f"--nproc {nproc} under a launcher that started {world} processes")
    from actscan.distributed.runtime import run_ranked

    raise typer.Exit(run_ranked(c.handle_errors(body), device.value if device else None))


def _fail_rank0(message: str) -> typer.Exit:
    """One line (rank 0's, under a launcher: the other ranks print nothing) and exit 2."""
    if os.environ.get("RANK", "0") == "0":
        print(f"actscan: error: {message}", file=sys.stderr)
    return typer.Exit(c.EXIT_USAGE)


def _profile(
    target: str,
    *,
    checks: CheckRunner | None,
    config: Any,
    dtype: Any,
    amp: Any,
    init: str | None,
    set_: list[str] | None,
    batch: int | None,
    seq_len: int | None,
    batches: int | None,
    seed: int | None,
    input_file: Any,
    device: Any,
    modules: str | None,
    no_backward: bool,
    dropout: bool,
    steps: int | None,
    lr: float | None,
    optimizer: Any,
    eps: float | None,
    weight_decay: float | None,
    warmup: int | None,
    no_attention: bool,
    plot: str | None,
    json_out: str | None,
    fmt: c.FormatOpt,
    output: str | None,
    fail_on: Any,
    input_shape: str | None,
    threshold: list[str] | None,
    quiet: bool,
    allow_nonfinite: bool,
    at_init: bool | None,
    all_modules: bool,
    show_config: bool,
) -> None:
    """The command itself, in one process or as one rank (only rank 0 writes)."""
    from actscan.distributed.launch import launched

    main = not launched() or os.environ.get("RANK", "0") == "0"
    settings = c.resolve_settings(
        fail_on=fail_on, dtype=dtype, amp=amp, batch=batch, seq_len=seq_len, batches=batches,
        seed=seed, device=device, modules=modules, threshold=threshold, dropout=dropout,
        steps=steps, optimizer=optimizer, lr=lr, eps=eps, weight_decay=weight_decay,
        warmup=warmup, no_backward=no_backward,
        no_attention=no_attention,
    )  # fmt: skip
    if show_config:
        _print_settings(settings)
        raise typer.Exit(c.EXIT_OK)
    if dtype is not None and amp is not None and dtype is not c.DTypeOpt.fp32:
        raise c.fail("--dtype and --amp together: autocast runs fp32 weights (drop --dtype)")
    c.check_outputs(fmt, output, json_out)
    if plot is not None:  # fail now, not after a long scan
        from actscan.render.plot import check_plot

        check_plot(plot)
    from actscan.api import TargetSpec, scan_target

    spec = TargetSpec(
        target=target, config=config, init=init, overrides=tuple(set_ or ()),
        input_file=input_file, input_shape=c.parse_shape(input_shape),
        allow_nonfinite=allow_nonfinite, at_init=at_init,
    )  # fmt: skip
    with c.ProgressSink(enabled=not quiet and main) as progress:
        scanned = scan_target(
            spec, settings, backward=not no_backward, progress=progress, checks=checks
        )
    from actscan.render.terminal import render_report

    report = scanned.report
    if not main:  # every rank holds the merged report; rank 0 writes it
        raise typer.Exit(c.gate_exit(report.findings, settings.fail_on))
    if plot is not None:
        from actscan.render.plot import plot_profile, profile_figure

        plot_profile(profile_figure(report), plot)
    c.emit(
        [report], fmt=fmt, output=output, json_path=json_out, fail_on=settings.fail_on,
        render=lambda con: render_report(
            report, con, all_modules=all_modules, quiet=quiet, ignored=scanned.ignored
        ),
        quiet=quiet,
    )  # fmt: skip
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
        console.print(f"ignore {ig.check}" + (f" at /{ig.layers}/" if ig.layers else "")
                      + f": {ig.reason}")  # fmt: skip
