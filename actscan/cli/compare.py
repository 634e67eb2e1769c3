"""`actscan compare A [B]`: two models, init schemes or precisions, side by side."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from actscan.cli import app
from actscan.cli import common as c

if TYPE_CHECKING:
    from actscan.compare import Divergence
    from actscan.report.report import Report

VsDType = Annotated[
    c.DTypeOpt | None, typer.Option("--vs-dtype", help="B runs in this dtype (same weights).")
]
VsAmp = Annotated[c.AmpOpt | None, typer.Option("--vs-amp", help="B autocasts to this dtype.")]
VsInit = Annotated[str | None, typer.Option("--vs-init", help="B re-initializes with SCHEME.")]
VsSet = Annotated[
    list[str] | None,
    typer.Option("--vs-set", help="Override a config field for B only: key=value (repeatable)."),
]
VsConfig = Annotated[Path | None, typer.Option("--vs-config", help="--config for B.")]
Plot = Annotated[
    str | None, typer.Option("--plot", help="Draw stream RMS vs k to PATH (.png/.svg/.pdf).")
]


@dataclass(frozen=True)
class Side:
    """How one side is built and run: what `build_and_scan` needs beyond shared settings."""

    tag: str  # "a" | "b"
    target: str
    config: Path | None
    init: str | None
    sets: tuple[str, ...]
    dtype: str | None
    amp: str | None

    def values(self, shared: dict[str, Any]) -> dict[str, Any]:
        return {**shared, "dtype": self.dtype, "amp": self.amp}

    def label(self) -> str:
        bits = [self.target]
        if self.init:
            bits.append(f"--init {self.init}")
        bits += [f"--set {s}" for s in self.sets]
        if self.dtype:
            bits.append(f"--dtype {self.dtype}")
        if self.amp:
            bits.append(f"--amp {self.amp}")
        return " ".join(bits) or self.target

    def label_vs(self, a: Side, vs_sets: list[str] | None) -> str:
        """B as "what changed from A" when both build the same TARGET."""
        if self.target != a.target or self.config != a.config:
            return self.label()
        bits = ["A"]
        if self.init != a.init:
            bits.append(f"--init {self.init}")
        bits += [f"--set {s}" for s in vs_sets or ()]
        if (self.dtype, self.amp) != (a.dtype, a.amp):
            bits.append(f"--dtype {self.dtype or 'model'}" if self.dtype or not self.amp else "")
            bits.append(f"--amp {self.amp}" if self.amp else "")
        return " ".join(b for b in bits if b)


def side_b(
    a: Side,
    *,
    target: str | None,
    config: Path | None,
    init: str | None,
    sets: list[str] | None,
    dtype: c.DTypeOpt | None,
    amp: c.AmpOpt | None,
) -> Side:
    """B inherits everything from A except what a --vs-* option (or TARGET B) changes.
    A --vs-amp alone runs B with the model's own weights (no inherited --dtype), and a
    --vs-dtype alone drops an inherited --amp: autocast and a cast do not combine."""
    b_dtype, b_amp = a.dtype, a.amp
    if dtype is not None or amp is not None:
        b_dtype = dtype.value if dtype is not None else None
        b_amp = amp.value if amp is not None else None
    return Side(
        tag="b", target=target or a.target, config=config or a.config, init=init or a.init,
        sets=a.sets + tuple(sets or ()), dtype=b_dtype, amp=b_amp,
    )  # fmt: skip


def check_precision(side: Side) -> None:
    if side.dtype not in (None, "fp32") and side.amp is not None:
        flag = "--dtype/--amp" if side.tag == "a" else "--vs-dtype/--vs-amp"
        raise c.fail(f"{flag} together: autocast runs fp32 weights (drop the dtype)")


def scan_side(
    side: Side,
    shared: dict[str, Any],
    *,
    input_file: Path | None,
    input_shape: str | None,
    backward: bool,
    allow_nonfinite: bool,
    progress: c.ProgressSink | None,
    ignores: Any = (),
) -> Report:
    """build_and_scan for one side, then the project's ignores (as profile applies them)."""
    from actscan.cli.profile import build_and_scan
    from actscan.settings import apply_ignores

    report = build_and_scan(
        side.target, side.values(shared), config=side.config, init=side.init,
        overrides=list(side.sets), input_file=input_file, input_shape=input_shape,
        backward=backward, allow_nonfinite=allow_nonfinite, progress=progress,
    )  # fmt: skip
    kept, _ = apply_ignores(report.findings, ignores)
    return replace(report, findings=kept)


def _divergence(
    a: Side,
    ra: Report,
    rb: Report,
    shared: dict[str, Any],
    *,
    input_file: Path | None,
    input_shape: str | None,
    allow_nonfinite: bool,
    scope: str,
) -> Divergence:
    """Same weights, two precisions: rebuild A's model once more (deterministic: same
    config, seed and file) and run the capture pass on deep copies of it."""
    from actscan.cli.profile import resolve_target
    from actscan.compare import Precision, default_inputs, precision_divergence
    from actscan.diagnose.thresholds import DEFAULT

    pa = Precision(ra.run.dtype, ra.run.amp)
    pb = Precision(rb.run.dtype, rb.run.amp)
    high, low, ref = (pa, pb, "a") if pa.bits >= pb.bits else (pb, pa, "b")
    resolved, source = resolve_target(
        a.target, shared, config=a.config, init=a.init, overrides=list(a.sets),
        input_file=input_file, input_shape=input_shape, allow_nonfinite=allow_nonfinite,
    )  # fmt: skip
    if source is None:
        source = default_inputs(resolved.info, ra.run.batch, ra.run.seq_len, int(shared["seed"]))
    th = DEFAULT.with_overrides(shared["thresholds"] or None)
    return precision_divergence(
        resolved.model, source, high=high, low=low, reference_side=ref,
        threshold=th.divergence_rel_err, scope=scope, device=shared["device"],
        model_type=resolved.info.family,
    )  # fmt: skip


@app.command("compare")
@c.handle_errors
def compare(
    a: Annotated[str, typer.Argument(help="Target A (any TARGET profile accepts).")],
    b: Annotated[
        str | None, typer.Argument(help="Target B (default: A, changed by the --vs-* options).")
    ] = None,
    config: c.ConfigOpt = None,
    vs_config: VsConfig = None,
    dtype: c.DType = None,
    vs_dtype: VsDType = None,
    amp: c.Amp = None,
    vs_amp: VsAmp = None,
    init: c.Init = None,
    vs_init: VsInit = None,
    set_: c.SetOpt = None,
    vs_set: VsSet = None,
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
    all_modules: Annotated[
        bool, typer.Option("--all", help="Every matched layer (and every layer's divergence).")
    ] = False,
    plot: Plot = None,
) -> None:
    """Compare two models, init schemes or precisions block by block (ratios are B ÷ A).

    Both sides run on identical inputs and seeds; exit 1 if either has a finding ≥ --fail-on.

    [bold]Examples[/bold]

      actscan compare gpt-48-naive gpt-48-scaled
      actscan compare gpt-48-naive --vs-init fan-in --vs-set branch_scale=depth
      actscan compare gpt2-124m --dtype fp32 --vs-dtype bf16
      actscan compare model.safetensors --vs-amp bf16 --json compare.json
    """
    from actscan.diagnose.thresholds import parse_threshold_options

    cli = {
        "fail_on": fail_on, "dtype": dtype, "amp": amp, "batch": batch, "seq_len": seq_len,
        "batches": batches, "seed": seed, "device": device, "modules": modules,
        "thresholds": parse_threshold_options(threshold) or None,
    }  # fmt: skip
    values, _, project = c.settings(cli)
    if b is None and not (vs_init or vs_set or vs_dtype or vs_amp or vs_config):
        raise c.fail(
            "nothing to compare: give a second TARGET or a --vs-init/--vs-set/--vs-dtype/"
            "--vs-amp option"
        )
    side_a = Side("a", a, config, init, tuple(set_ or ()), values["dtype"], values["amp"])
    side = side_b(
        side_a, target=b, config=vs_config, init=vs_init, sets=vs_set, dtype=vs_dtype, amp=vs_amp
    )
    for s in (side_a, side):
        check_precision(s)
    c.check_outputs(fmt, output, json_out)
    same_weights = (side.target, side.config, side.init, side.sets) == (
        side_a.target, side_a.config, side_a.init, side_a.sets,
    )  # fmt: skip
    run = dict(
        input_file=input_file, input_shape=input_shape, backward=not no_backward,
        allow_nonfinite=allow_nonfinite,
    )  # fmt: skip

    from actscan.compare import compare_reports

    with c.ProgressSink(enabled=not quiet) as progress:
        ra = scan_side(side_a, values, progress=progress, ignores=project.ignores, **run)  # type: ignore[arg-type]
        rb = scan_side(side, values, progress=progress, ignores=project.ignores, **run)  # type: ignore[arg-type]
        div = None
        precision_differs = (ra.run.dtype, ra.run.amp) != (rb.run.dtype, rb.run.amp)
        known = {"fp32", "bf16", "fp16"}
        if same_weights and precision_differs and {ra.run.dtype, rb.run.dtype} <= known:
            progress.stage("precision divergence")
            div = _divergence(
                side_a, ra, rb, values, input_file=input_file, input_shape=input_shape,
                allow_nonfinite=allow_nonfinite, scope="all" if all_modules else "stream+branches",
            )  # fmt: skip
    cmp = compare_reports(
        ra, rb, label_a=side_a.label(), label_b=side.label_vs(side_a, vs_set),
        divergence=div,
    )  # fmt: skip
    if precision_differs and not same_weights:
        cmp = replace(
            cmp,
            notes=(
                *cmp.notes,
                "the sides differ in weights as well as precision: no divergence pass "
                "(compare one model: --dtype X --vs-dtype Y)",
            ),
        )
    if plot is not None:
        from actscan.report.plot import Series, plot_streams

        plot_streams(
            [
                Series(f"A: {cmp.label_a}", tuple(p.k for p in ra.stream),
                       tuple(p.rms for p in ra.stream)),
                Series(f"B: {cmp.label_b}", tuple(p.k for p in rb.stream),
                       tuple(p.rms for p in rb.stream)),
            ],
            plot, title="Residual stream RMS vs k",
        )  # fmt: skip

    from actscan.report.render_compare import render_comparison

    c.emit(
        [ra, rb], fmt=fmt, output=output, json_path=json_out, fail_on=values["fail_on"],
        render=lambda con: render_comparison(cmp, con, quiet=quiet, all_layers=all_modules),
        quiet=quiet, json_text=cmp.to_json,
    )  # fmt: skip
    raise typer.Exit(c.gate_exit(ra.findings + rb.findings, values["fail_on"]))
