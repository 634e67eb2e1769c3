"""From the recorded pass to the step loop: `--steps N` after the step-0 profile.

The profile's batch-0 gradient drives the first update (no second pass), the pass's own
cast and autocast run every step, and the caller's kept weights stand for W_0
(actscan.measure.state). The loop itself is `actscan.steps.loop.run_steps`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Any

from torch import nn

from actscan.errors import UsageError
from actscan.measure.lowprec import delayed_steps
from actscan.measure.profile import Profiled, Progress, StepStart, step0_again
from actscan.measure.state import CallerWeights, kept_state
from actscan.measure.trace import trace_batch, trace_run
from actscan.records import Dynamics, ParamRecord, StreamPoint, TraceRecord
from actscan.steps.loop import StepSpec, StepsRaw, dynamics_record, run_steps

__all__ = ["diverged_step", "steps_record", "take_steps", "trace_steps", "with_delayed"]


def take_steps(
    model: nn.Module,
    steps: StepSpec,
    profiled: Profiled,
    kept: CallerWeights | None,
    vocab_size: int | None = None,
    progress: Progress | None = None,
) -> StepsRaw | None:
    """`steps.steps` optimizer steps from the profiled weights, measured t = 0..N (None:
    no steps asked for), run as the profile ran (`profiled`: its inputs, cast, autocast
    and ranks). The caller's state restore gives the weights back afterwards."""
    if not steps.steps:
        return None
    if profiled.step0 is None:
        raise UsageError("--steps: no parameter requires grad, so there is nothing to train")
    return _run(model, steps, profiled, kept, vocab_size, progress)


def _run(
    model: nn.Module,
    steps: StepSpec,
    profiled: Profiled,
    kept: CallerWeights | None,
    vocab_size: int | None,
    progress: Progress | None,
    step0: StepStart | None = None,
) -> StepsRaw:
    """The steps from `step0` (default: the pass's own, whose gradients the first update
    frees as it reads them); a replay (`step0` given: the trace's) leaves the fp8
    delayed-scaling history alone, which the measured steps already wrote."""
    delayed = profiled.delayed if step0 is None else None
    step0 = step0 or profiled.step0
    assert step0 is not None
    with delayed_steps(model, delayed) as batch_watch:
        return _loop(model, steps, profiled, kept, vocab_size, progress, batch_watch, step0)


def _loop(
    model: nn.Module,
    steps: StepSpec,
    profiled: Profiled,
    kept: CallerWeights | None,
    vocab_size: int | None,
    progress: Progress | None,
    batch_watch: Callable[[], AbstractContextManager[Any]],
    step0: StepStart,
) -> StepsRaw:
    spec, chosen = profiled.spec, profiled.chosen
    return run_steps(
        model,
        steps,
        layout=profiled.layout,
        source=chosen.source,
        step0=step0,
        loss_of=chosen.loss_of,
        prepare=spec.cast,
        autocast=spec.autocast,
        loss_scale=spec.loss_scale,
        vocab_size=vocab_size,
        progress=progress,
        attention=spec.attention,
        checked={r.name for r in profiled.attention},
        ranks=profiled.ranks.step_ranks(),
        w0=kept,
        batch_watch=batch_watch,
    )


def with_delayed(profiled: Profiled) -> Profiled:
    """The step-0 records with the steps' fp8 delayed-scaling figures (`--formats` with
    fp8 and `--steps`; unchanged otherwise)."""
    d = profiled.delayed
    if d is None:
        return profiled
    records = d.merged(profiled.low_precision)
    notes = profiled.notes
    if d.unmerged:
        notes += (
            "--formats fp8 --steps: the ranks cast different GEMMs, so each kept its own "
            "delayed-scaling history; the delayed figures are this rank's rows, not merged",
        )
    return replace(profiled, low_precision=records, notes=notes)


def diverged_step(raw: StepsRaw | None) -> int | None:
    """The first step whose figures went non-finite (None: none did)."""
    return next((t for t, bad in enumerate(raw.nonfinite) if bad), None) if raw else None


def trace_steps(
    model: nn.Module,
    steps: StepSpec,
    profiled: Profiled,
    raw: StepsRaw | None,
    *,
    dropout: bool,
    vocab_size: int | None = None,
) -> TraceRecord | None:
    """The trace of the step where the run diverged (None: it did not, or it is step 0,
    which the profile's trace covers). The steps before it are taken again, unmeasured
    by the trace, from the caller's weights (restored afterwards as by the run), so the
    traced pass sees W_t and step t's batch, as step t did."""
    t = diverged_step(raw)
    if not t or profiled.ranks.sharded:
        return None
    spec = profiled.spec
    with kept_state(model, spec.device, spec.dtype, dropout=dropout, weights=True) as kept:
        step0 = step0_again(model, profiled)  # the first run freed the pass's gradients
        _run(model, replace(steps, steps=t), profiled, kept, vocab_size, None, step0)
        batch = spec.cast(profiled.ranks.rows_of(profiled.chosen.source)(t))
        return trace_batch(model, batch, trace_run(profiled, reason="diverged", step=t, batch=t))


def steps_record(
    raw: StepsRaw | None, stream: Sequence[StreamPoint], params: Sequence[ParamRecord]
) -> Dynamics | None:
    """The report's `dynamics` (None: the run took no steps)."""
    return dynamics_record(raw, stream, params) if raw is not None else None
