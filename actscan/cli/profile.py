"""`actscan profile TARGET`: measure one model, print tables and findings."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from actscan.cli import app
from actscan.cli import common as c


def resolve_target(
    target: str,
    values: dict[str, Any],
    *,
    config: Path | None,
    init: str | None,
    overrides: list[str] | None,
    input_file: Path | None,
    input_shape: str | None,
    allow_nonfinite: bool,
) -> tuple[Any, Any]:
    """TARGET → (Resolved, input source or None). Shared by profile, compare and sweep."""
    from actscan.models.arch import parse_set
    from actscan.targets.resolve import TargetOptions, resolve

    opts = TargetOptions(
        config=config, init=init, overrides=parse_set(overrides), seed=int(values["seed"]),
        input_shape=c.parse_shape(input_shape), allow_nonfinite=allow_nonfinite,
        batch=int(values["batch"]), seq_len=values["seq_len"],
    )  # fmt: skip
    resolved = resolve(target, opts)
    inputs: Any = resolved.inputs
    if input_file is not None:
        from actscan.targets.inputs_file import load_input_file

        inputs = load_input_file(input_file, resolved, opts)
    return resolved, inputs


def build_and_scan(
    target: str,
    values: dict[str, Any],
    *,
    config: Path | None,
    init: str | None,
    overrides: list[str] | None,
    input_file: Path | None,
    input_shape: str | None,
    backward: bool,
    allow_nonfinite: bool,
    progress: c.ProgressSink | None = None,
) -> Any:
    """Resolve TARGET and scan it with effective settings. Shared by compare and sweep."""
    from actscan.scanner import scan

    if progress:
        progress.stage(f"building {target}")
    resolved, inputs = resolve_target(
        target, values, config=config, init=init, overrides=overrides, input_file=input_file,
        input_shape=input_shape, allow_nonfinite=allow_nonfinite,
    )  # fmt: skip
    report = scan(
        resolved.model,
        inputs=inputs,
        dtype=values["dtype"],
        amp=values["amp"],
        batches=int(values["batches"]),
        backward=backward,
        modules=values["modules"],
        thresholds=values["thresholds"] or None,
        device=values["device"],
        seed=int(values["seed"]),
        batch=int(values["batch"]),
        seq_len=values["seq_len"],
        info=resolved.info,
        init=init,
        progress=progress,
    )
    if resolved.notes:
        from dataclasses import replace

        report = replace(report, notes=tuple(dict.fromkeys(resolved.notes + report.notes)))
    return report


@app.command("profile")
@c.handle_errors
def profile(
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
    json_out: c.JsonOut = None,
    fmt: c.Format = c.FormatOpt.table,
    output: c.Output = None,
    fail_on: c.FailOn = None,
    input_shape: c.InputShape = None,
    threshold: c.ThresholdOpt = None,
    quiet: c.Quiet = False,
    allow_nonfinite: c.AllowNonfinite = False,
    all_modules: Annotated[bool, typer.Option("--all", help="Table of every module.")] = False,
    show_config: Annotated[
        bool, typer.Option("--show-config", help="Print the effective settings and exit.")
    ] = False,
) -> None:
    """Measure one forward+backward pass and report the scale of activations and gradients.

    [bold]Examples[/bold]

      actscan profile sample_models/healthy.safetensors
      actscan profile configs/gpt-48-naive.yaml --init fan-in --set branch_scale=depth
      actscan profile path/to/hf-model --dtype bf16 --json report.json
      actscan profile mypkg.models:build --input-shape 8,128 --fail-on warn
    """
    from actscan.diagnose.thresholds import parse_threshold_options

    cli = {
        "fail_on": fail_on, "dtype": dtype, "amp": amp, "batch": batch, "seq_len": seq_len,
        "batches": batches, "seed": seed, "device": device, "modules": modules,
        "thresholds": parse_threshold_options(threshold) or None,
    }  # fmt: skip
    values, sources, project = c.settings(cli)
    if show_config:
        _print_settings(values, sources, project)
        raise typer.Exit(c.EXIT_OK)
    if dtype is not None and amp is not None and dtype is not c.DTypeOpt.fp32:
        raise c.fail("--dtype and --amp together: autocast runs fp32 weights (drop --dtype)")
    c.check_outputs(fmt, output, json_out)

    with c.ProgressSink(enabled=not quiet) as progress:
        report = build_and_scan(
            target, values, config=config, init=init, overrides=set_, input_file=input_file,
            input_shape=input_shape, backward=not no_backward, allow_nonfinite=allow_nonfinite,
            progress=progress,
        )  # fmt: skip
    from dataclasses import replace

    from actscan.report.render import render_report
    from actscan.settings import apply_ignores

    kept, ignored = apply_ignores(report.findings, project.ignores)
    report = replace(report, findings=kept)

    c.emit(
        [report], fmt=fmt, output=output, json_path=json_out, fail_on=values["fail_on"],
        render=lambda con: render_report(
            report, con, all_modules=all_modules, quiet=quiet, ignored=ignored
        ),
        quiet=quiet,
    )  # fmt: skip
    raise typer.Exit(c.gate_exit(report.findings, values["fail_on"]))


def _print_settings(values: dict[str, Any], sources: dict[str, str], project: Any) -> None:
    """One row per setting and per threshold (defaults included), with where it came from."""
    from rich.table import Table

    from actscan.diagnose.thresholds import DEFAULT

    console = c.make_console()
    path = getattr(project, "path", None)
    console.print(f"project config: {path if path is not None else 'none found'}")

    def where(src: str) -> str:  # the file's name: its full path is on the line above
        return path.name if path is not None and src == str(path) else src

    table = Table(title="Effective settings", title_justify="left")
    table.add_column("setting")
    table.add_column("value")
    table.add_column("from")
    for key, value in values.items():
        if key == "thresholds":
            continue
        shown = "—" if value in (None, {}) else str(value)
        table.add_row(key.replace("_", "-"), shown, where(sources.get(key, "default")))
    overrides = values.get("thresholds") or {}
    for name, value in DEFAULT.with_overrides(overrides).as_dict().items():
        src = sources.get(f"thresholds.{name}", "default") if name in overrides else "default"
        table.add_row(f"threshold {name}", f"{value:g}", where(src))
    console.print(table)
    for ig in getattr(project, "ignores", ()):
        console.print(f"ignore {ig.check}" + (f" at /{ig.layers}/" if ig.layers else "")
                      + f": {ig.reason}")  # fmt: skip
