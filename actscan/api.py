"""From a target and settings to a Report: the one path `profile`, `compare` and `sweep` share.

`scan_target(TargetSpec(...), Settings(...))` resolves the target (file, folder, config,
shipped name or `module:callable`), builds its inputs, runs the spine
(`actscan.run.scan_model`) with the settings and applies the ignores, so every command
(and a Python caller) gates on the same findings. `precision_divergence_of` reruns a
target for compare's same-weights, two-precisions pass.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from actscan.diagnose import evaluate
from actscan.errors import BUILD_ADVICE, RUN_ADVICE, resource_limits
from actscan.models.arch import parse_set
from actscan.settings import Settings, apply_ignores
from actscan.targets.footprint import RunPlan
from actscan.targets.resolve import resolve
from actscan.targets.resolved import TargetOptions

if TYPE_CHECKING:
    from actscan.compare.pairs import Divergence
    from actscan.measure.inputs import InputSource
    from actscan.records import Finding
    from actscan.report.report import Report
    from actscan.run import CheckRunner
    from actscan.targets.resolved import Resolved

__all__ = ["Progress", "Scanned", "TargetSpec", "Wiring", "build_target", "scan_target"]


class Progress(Protocol):
    """What a progress display offers: a stage name, and scan()'s (stage, done, total)."""

    def stage(self, text: str) -> None: ...

    def __call__(self, stage: str, done: int, total: int) -> None: ...


@dataclass(frozen=True)
class Wiring:
    """What the commands are wired to, passed as typer's context object: tests give the
    CLI a planted check runner with `CliRunner().invoke(app, args, obj=Wiring(checks=...))`.
    `checks` None: the real checks (actscan.diagnose.evaluate)."""

    checks: CheckRunner | None = None

    @classmethod
    def of(cls, obj: Any) -> Wiring:
        """typer's `ctx.obj` as a Wiring (None, the plain command line: the defaults)."""
        return obj if isinstance(obj, Wiring) else cls()


@dataclass(frozen=True)
class TargetSpec:
    """What to build: TARGET and the options that change the model or its inputs.

    `overrides` are `--set key=value` strings; `input_file` is `--input` (token ids or
    text); `input_shape` asks for random float inputs of that shape.
    """

    target: str
    config: Path | None = None
    init: str | None = None
    overrides: tuple[str, ...] = ()
    input_file: Path | None = None
    input_shape: tuple[int, ...] | None = None
    allow_nonfinite: bool = False
    # --at-init/--trained: judge the weights as an initialization or not; None: the
    # resolver's judgement (config-built and module:callable models are at init).
    at_init: bool | None = None
    # How the user spelled --set/--init: "--vs-" for compare's and sweep's side B, so a
    # mistake names the option that was typed (--vs-set), not A's.
    option_prefix: str = "--"


@dataclass(frozen=True)
class Scanned:
    """A target's report as the gate sees it (ignored findings removed) and what the
    project's ignores took out, each with its reason (the table prints them)."""

    report: Report
    ignored: tuple[tuple[Finding, str], ...] = ()


def build_target(spec: TargetSpec, settings: Settings) -> tuple[Resolved, InputSource | None]:
    """TARGET → (the resolved model, its inputs or None: scan() invents token ids)."""

    opts = TargetOptions(
        config=spec.config,
        init=spec.init,
        overrides=parse_set(list(spec.overrides), f"{spec.option_prefix}set"),
        option_prefix=spec.option_prefix,
        seed=settings.seed,
        input_shape=spec.input_shape,
        allow_nonfinite=spec.allow_nonfinite,
        batch=settings.batch,
        seq_len=settings.seq_len,
        at_init=spec.at_init,
        plan=RunPlan(
            dtype=str(getattr(settings.dtype, "value", settings.dtype) or "fp32"),
            batch=settings.batch,
            seq_len=settings.seq_len,
            backward=settings.backward,
            steps=settings.steps,
            optimizer=settings.optimizer,
            device=settings.device,
            force=settings.force,
        ),
    )
    from actscan.distributed.runtime import current

    run = current()
    if run is not None:  # sharded from the start: no rank builds the whole model
        from actscan.distributed.build import build_sharded
        from actscan.distributed.telemetry import track

        resolved = build_sharded(spec.target, opts, run)
        track(resolved.model)
    else:
        resolved = resolve(spec.target, opts)
    inputs: Any = resolved.inputs
    if spec.input_file is not None:
        from actscan.targets.inputs_file import load_input_file

        inputs = load_input_file(spec.input_file, resolved, opts)
    return resolved, inputs


def scan_target(
    spec: TargetSpec | str,
    settings: Settings | None = None,
    *,
    backward: bool = True,
    progress: Progress | None = None,
    checks: CheckRunner | None = None,
) -> Scanned:
    """Resolve `spec`, scan it with `settings` (default: `Settings()`), apply the ignores.

    The returned report carries the resolver's notes ahead of the run's and only the
    findings no ignore matches, so `report.assert_healthy` and the CLI's `--fail-on`
    gate on the same findings. `checks` replaces the check runner (None: the real checks,
    actscan.diagnose.evaluate).
    """
    from actscan.run import preload_kernels, scan_model  # looked up per call: tests may watch it

    spec = TargetSpec(spec) if isinstance(spec, str) else spec
    settings = Settings() if settings is None else settings
    preload_kernels(settings)
    if progress is not None:
        progress.stage(f"building {spec.target}")
    with resource_limits(f"building {spec.target}", BUILD_ADVICE):
        resolved, inputs = build_target(spec, settings)
    decode = None
    if spec.input_file is not None:
        from actscan.targets.inputs_file import token_decoder

        decode = token_decoder(spec.input_file, resolved)
    run = replace(settings, backward=settings.backward and backward, init=spec.init, ignores=())
    with resource_limits(f"running {spec.target}", RUN_ADVICE):
        report = scan_model(
            resolved.model,
            run,
            inputs=inputs,
            info=resolved.info,
            progress=progress,
            decode_token=decode,
            checks=checks or evaluate,
        )
    if resolved.notes:
        report = replace(report, notes=tuple(dict.fromkeys(resolved.notes + report.notes)))
    kept, ignored = apply_ignores(report.findings, settings.ignores)
    return Scanned(replace(report, findings=kept), ignored)


def precision_divergence_of(
    spec: TargetSpec, settings: Settings, a: Report, b: Report, *, scope: str
) -> Divergence:
    """Same weights, two precisions (those `a` and `b` ran in): rebuild the model of
    `spec` once more (deterministic: same config, seed and file) and compare each chosen
    module's output in the lower precision against the higher one."""
    from actscan.compare.precision import Precision, default_inputs, precision_divergence

    pa = Precision(a.run.dtype, a.run.amp)
    pb = Precision(b.run.dtype, b.run.amp)
    high, low, ref = (pa, pb, "a") if pa.bits >= pb.bits else (pb, pa, "b")
    resolved, source = build_target(spec, settings)
    if source is None:
        source = default_inputs(resolved.info, a.run.batch, a.run.seq_len, settings.seed)
    return precision_divergence(
        resolved.model,
        source,
        high=high,
        low=low,
        reference_side=ref,
        threshold=settings.threshold_set().divergence_rel_err,
        scope=scope,
        device=settings.device,
        model_type=resolved.info.family,
    )
