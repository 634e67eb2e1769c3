"""The spine: one run of actscan, stage by stage, in the order the data flows.

`scan_model` is the whole path from a model and its `Settings` to a Report, one stage per
line; each stage's own module says how it works. `scan()` (the Python API) and
`actscan.api.scan_target` (the CLI's path) both call it.

The run leaves the model exactly as it found it (actscan.measure.state says what that
covers). It is in train mode, as training runs: BatchNorm normalises with the batch's
statistics (in eval mode at init it is the identity, which hides what training sees).
Dropout is off by default, so runs are reproducible and comparable (`dropout=True` keeps it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any, cast

import torch
from torch import nn

from actscan.diagnose import CheckContext, evaluate
from actscan.diagnose.thresholds import DEFAULT, Thresholds
from actscan.distributed.ranks import ShardedPass
from actscan.distributed.runtime import current as dist_current
from actscan.layout.detect import detect_layout
from actscan.layout.probe import PassProbe, Probe, probe_pass
from actscan.measure import compiled, fused_casts, fused_reduce
from actscan.measure.model_inputs import ChosenInputs, choose_inputs
from actscan.measure.params import param_records
from actscan.measure.prepare import (
    TORCH_DTYPES,
    dtype_name,
    one_row_hint,
    refuse_meta,
    resolve_device,
    unwrap_compiled,
)
from actscan.measure.profile import (
    LocalPass,
    PassSpec,
    Profiled,
    Progress,
    first_batch,
    record_pass,
    run_info,
)
from actscan.measure.recorder import check_modules
from actscan.measure.results import Measured, build_records
from actscan.measure.state import kept_state
from actscan.measure.trace import trace_profile, untraced_note
from actscan.records import BlockProof, Finding, Layout, ModelInfo, ParamRecord, Skip
from actscan.report.report import Report
from actscan.settings import SOURCE_SCAN, Ignore, Settings, apply_ignores
from actscan.steps import fused_moved
from actscan.steps.loop import StepSpec, StepsRaw
from actscan.steps.take import steps_record, take_steps, trace_steps, with_delayed
from actscan.targets.info import infer_info
from actscan.targets.stored_dtype import stored_dtype_note

__all__ = [
    "CheckRunner",
    "infer_info",
    "preload_kernels",
    "scan",
    "scan_model",
    "scan_settings",
    "with_at_init",
]

# The check runner: the records of one run → (findings, checks that did not run).
CheckRunner = Callable[[CheckContext], tuple[tuple[Finding, ...], tuple[Skip, ...]]]


def scan_model(
    model: nn.Module,
    settings: Settings,
    *,
    inputs: Any = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    info: ModelInfo | None = None,
    layout: Layout | None = None,
    progress: Progress | None = None,
    decode_token: Callable[[int], str] | None = None,
    checks: CheckRunner = evaluate,
) -> Report:
    """Measure `model` as `settings` say and judge it with `checks`: the whole run.

    `inputs`, `loss_fn`, `info`, `layout` and `decode_token` are scan()'s (None: chosen
    here); `checks` runs the checks on the run's records (actscan.diagnose.evaluate).
    The findings `settings.ignores` match leave the report.
    """
    s, ranks = settings, pass_ranks()
    steps = step_spec(s)
    model, compiled = unwrap_compiled(model)
    refuse_meta(model)
    info = with_at_init(info or infer_info(model), s.at_init)
    layout = layout or detect_layout(model, info.family)
    spec = pass_spec(model, s, info)
    chosen = choose_inputs(
        model, info, inputs, loss_fn, batch=s.batch, seq_len=s.seq_len, seed=s.seed
    )
    ranks.check(model, spec, s.steps, chosen.source)
    with (
        one_row_hint(model),
        kept_state(model, spec.device, spec.dtype, dropout=s.dropout, weights=s.steps > 0) as kept,
    ):
        profiled, probe = profile_pass(model, layout, chosen, spec, ranks, s, info, progress)
        traced = trace_profile(model, profiled, s.trace)
        raw_steps = take_steps(model, steps, profiled, kept, info.vocab_size, progress)
        profiled = with_delayed(profiled)  # --formats fp8 over the steps: delayed scaling
    if traced is None or traced.first is None:
        replay = trace_steps(
            model, steps, profiled, raw_steps, dropout=s.dropout, vocab_size=info.vocab_size
        )
        traced = replay or traced
    params = param_records(model, probe.proof.layout, probe, measure=ranks.moments)
    measured = build_records(model, profiled, s.threshold_set(), decode_token)
    ctx = replace(check_context(s, info, profiled, measured, params, raw_steps), trace=traced)
    found, skipped = checks(ctx)
    findings, _ = apply_ignores(found, s.ignores)
    untraced = untraced_note(profiled, s.trace)
    notes = (layout.note, compiled, *spec.notes, *probe.notes, *profiled.notes, untraced)
    return report_of(ctx, measured, findings, skipped, probe.proof.proofs, notes)


def scan(
    model: nn.Module,
    inputs: Any = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    *,
    dtype: str | torch.dtype | None = None,
    batches: int = 1,
    backward: bool = True,
    modules: str | None = None,
    thresholds: Mapping[str, float | str] | Thresholds | None = None,
    amp: str | None = None,
    device: str | torch.device | None = None,
    seed: int = 0,
    batch: int = 4,
    seq_len: int | None = None,
    info: ModelInfo | None = None,
    layout: Layout | None = None,
    init: str | None = None,
    channels: bool = True,
    progress: Progress | None = None,
    ignore: Iterable[Ignore | Mapping[str, Any]] | None = None,
    at_init: bool | None = None,
    dropout: bool = False,
    steps: int = 0,
    optimizer: str = "adamw",
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    warmup: int = 0,
    attention: bool = True,
    decode_token: Callable[[int], str] | None = None,
    trace: bool = False,
    formats: str | Iterable[str] | None = None,
    gemm_error: bool = False,
) -> Report:
    """Measure one forward+backward pass (× `batches`) of `model`.

    The API is in the README, "pytest".

        inputs: a tensor, a tuple of positional args, a dict of kwargs, a list of those (one
          per batch) or a callable batch_index -> one of those. None: random token ids of
          shape (batch, seq_len) for language models and encoders.
        loss_fn(output) -> scalar tensor; default: next-token cross-entropy for language
          models, a fixed random projection for encoders, else mean square of the output.
        ignore: findings you accept, as `[tool.actscan] ignore` lists them: rules
          {"check": id, "reason": why, "layers": regex (optional)} or `Ignore`s. Matching
          findings leave `report.findings`, so `assert_healthy` gates as the CLI does;
          `find_project_config().ignores` (actscan.settings) gives the project's own.
        at_init: whether the weights are an initialization (init-scale checks run). None:
          `info.at_init` when `info` is given, else True (a module built in code is taken to
          be at init); pass False for trained weights.
        dropout: keep dropout on (nn.Dropout* modules and the dropout rates attention
          modules and HF configs hold). Off by default: the run is in train mode (norms use
          batch statistics) but reproducible.
        steps: after the step-0 profile, take this many optimizer steps (`optimizer`
          "adamw" | "adam" | "sgd", `lr`, `betas`, `eps`, `weight_decay`, linear
          `warmup` steps) and measure each t = 0..N into `report.dynamics`
          (actscan.steps.loop says what and how). The report's layers, stream and
          findings stay the step-0 measurement; the model's weights, `.grad`, modes and
          buffers are restored bit for bit afterwards, also when a step raises. A model
          with `actscan_param_groups(lr) -> list[dict]` trains with its own param groups.
          As a rank of a distributed run, the optimizer steps the FSDP2 shards and every
          figure is reduced across ranks (actscan.distributed.steps); each rank restores
          its own shards.
        attention: per-head attention probes (score max/std, entropy, sink: the report's
          `attention`); False switches them off (`--no-attention`).
        decode_token: token id -> its text (the tokenizer's), for the per-token view
          (`top_values[].text`, massive-activations); None: ids only.
        trace: rerun batch 0 op by op and name the first operation out of range
          (`report.trace`; actscan.measure.trace); it runs by itself when the run breaks.
        formats: "fp8,mxfp8,nvfp4" (or a list): cast every GEMM's input, weight and output
          gradient in these formats during the pass (`report.low_precision`); None: off.
        gemm_error: with `formats`, also each forward GEMM's relative output error
          ‖Q(X)Q(W)ᵀ − XWᵀ‖/‖XWᵀ‖ in each format (`LowPrecRecord.gemm_error`).
    """
    settings = scan_settings(
        dtype=dtype,
        amp=amp,
        batch=batch,
        seq_len=seq_len,
        batches=batches,
        seed=seed,
        device=device,
        modules=modules,
        dropout=dropout,
        steps=steps,
        optimizer=optimizer,
        lr=lr,
        betas=betas,
        eps=eps,
        weight_decay=weight_decay,
        warmup=warmup,
        attention=attention,
        backward=backward,
        channels=channels,
        init=init,
        at_init=at_init,
        thresholds=thresholds,
        ignore=ignore,
        trace=trace,
        formats=formats if formats is None or isinstance(formats, str) else tuple(formats),
        gemm_error=gemm_error,
    )
    return scan_model(
        model,
        settings,
        inputs=inputs,
        loss_fn=loss_fn,
        info=info,
        layout=layout,
        progress=progress,
        decode_token=decode_token,
    )


# -- settings for the stages ------------------------------------------------------------------
def scan_settings(
    *,
    thresholds: Mapping[str, float | str] | Thresholds | None = None,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    **values: Any,
) -> Settings:
    """scan()'s keywords as `Settings`, validated once by the settings table with scan()'s
    messages; a torch dtype or device is read by its name, a `Thresholds` by its overrides."""
    if isinstance(dtype, torch.dtype) and dtype in TORCH_DTYPES.values():
        dtype = dtype_name(dtype)  # by its name, as the CLI gives it
    if isinstance(thresholds, Thresholds):
        defaults = DEFAULT.as_dict()
        thresholds = {k: v for k, v in thresholds.as_dict().items() if v != defaults[k]}
    dev = None if device is None else str(device)
    return Settings.given(SOURCE_SCAN, thresholds=thresholds, dtype=dtype, device=dev, **values)


def preload_kernels(s: Settings) -> None:
    """Start loading, in the background, the compiled CPU kernels a run with these
    settings uses (the recorder's read of each output; the casts with `--formats`; the
    update figures with `--steps`): the CLI calls it before it builds the model, so their
    load (llvmlite's builds ~0.07 s; numba's import and cache load for the casts ~0.5 s)
    overlaps the build (actscan.measure.compiled)."""
    device = str(s.device or "cpu")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if not device.startswith("cpu"):
        return  # the kernels are CPU-only
    loaders = [fused_reduce.loader]
    if s.formats:
        loaders.append(fused_casts.loader)
    if s.steps:
        loaders.append(fused_moved.loader)
    compiled.preload(*loaders)


def step_spec(s: Settings) -> StepSpec:
    """How the steps run, from settings the table has already checked."""
    betas = cast(tuple[float, float], tuple(s.betas))
    return StepSpec(s.steps, s.optimizer, s.lr, betas, s.eps, s.weight_decay, s.warmup)


def pass_spec(model: nn.Module, s: Settings, info: ModelInfo) -> PassSpec:
    """How the recorded pass runs, from the settings (device None: the model's own); a
    checkpoint stored in another dtype than the run's says so."""
    dtype = TORCH_DTYPES[s.dtype] if isinstance(s.dtype, str) else s.dtype
    check_modules(model, s.modules)
    spec = PassSpec.of(
        model,
        resolve_device(s.device, model),
        dtype,
        amp=s.amp,
        batches=s.batches,
        backward=s.backward,
        channels=s.channels,
        attention=s.attention,
        modules=s.modules,
        family=info.family,
        first_step=s.steps > 0,
        formats=tuple(s.formats.split(",")) if s.formats else (),
        gemm_error=s.gemm_error,
    )
    stored = stored_dtype_note(info.arch, spec.dtype_name)
    return replace(spec, notes=(*spec.notes, stored)) if stored else spec


def profile_pass(
    model: nn.Module,
    layout: Layout,
    chosen: ChosenInputs,
    spec: PassSpec,
    ranks: LocalPass,
    s: Settings,
    info: ModelInfo,
    progress: Progress | None,
) -> tuple[Profiled, Probe]:
    """The recorded pass, with the layout proof and the at-init usage riding on its first
    forward: one forward per batch. With dropout on, or as a rank of a distributed run,
    they take a forward of their own first (actscan.layout.probe says why)."""
    if s.dropout or ranks.sharded:
        first = first_batch(chosen, spec)
        probe = probe_pass(model, layout, first, at_init=info.at_init, autocast=spec.autocast)
        ranks.settle(model)
        return record_pass(model, probe.proof.layout, chosen, spec, ranks, progress), probe
    batch = max(chosen.batch_size(), 1)
    rider = PassProbe(model, layout, at_init=info.at_init, batch=batch)
    profiled = record_pass(model, layout, chosen, spec, ranks, progress, ride=rider)
    return profiled, rider.probe()


def pass_ranks() -> LocalPass:
    """How this process's pass meets the others: alone, or as a rank of the current
    distributed run (actscan.distributed.runtime)."""
    run = dist_current()
    return LocalPass() if run is None else ShardedPass(run)


# -- the Report ------------------------------------------------------------------------------
def check_context(
    s: Settings,
    info: ModelInfo,
    profiled: Profiled,
    measured: Measured,
    params: tuple[ParamRecord, ...],
    raw_steps: StepsRaw | None,
) -> CheckContext:
    """Everything the checks read: the run's records, and the thresholds they judge by."""
    return CheckContext(
        info=with_blocks(info, profiled.layout),
        run=run_info(profiled, seed=s.seed, init=s.init, dropout=s.dropout),
        layout=profiled.layout,
        layers=measured.layers,
        stream=measured.stream,
        fit=measured.fit,
        params=params,
        thresholds=s.threshold_set(),
        streams=measured.streams,
        dynamics=steps_record(raw_steps, measured.stream, params),
        attention=profiled.attention,
        low_precision=profiled.low_precision,
    )


def report_of(
    ctx: CheckContext,
    measured: Measured,
    findings: tuple[Finding, ...],
    skipped: tuple[Skip, ...],
    proofs: tuple[BlockProof, ...],
    notes: tuple[str | None, ...],
) -> Report:
    """The Report of one run: its records, the checks' verdicts and the notes of every
    stage (in the order the stages ran, each once)."""
    return Report(
        model=ctx.info,
        run=ctx.run,
        layers=measured.layers,
        stream=measured.stream,
        findings=findings,
        summary=measured.summary,
        params=ctx.params,
        notes=tuple(dict.fromkeys(n for n in notes if n)),
        branches=measured.branches,
        layout=proofs,
        skipped=skipped,
        streams=measured.streams,
        dynamics=ctx.dynamics,
        attention=ctx.attention,
        channel_maxima=measured.channel_maxima,
        trace=ctx.trace,
        low_precision=ctx.low_precision,
    )


# -- what the model is ----------------------------------------------------------------------
def with_at_init(info: ModelInfo, at_init: bool | None) -> ModelInfo:
    """`info` with the caller's at-init judgement (`--at-init/--trained`, `scan(at_init=)`);
    None keeps the resolver's."""

    return info if at_init is None or at_init == info.at_init else replace(info, at_init=at_init)


def with_blocks(info: ModelInfo, layout: Layout) -> ModelInfo:
    """`info` with the number of blocks the proved layout found."""
    return replace(info, n_blocks=len(layout.blocks)) if layout.blocks else info
