"""From the recorded pass to the step loop: `--steps N` after the step-0 profile.

The profile's batch-0 gradient drives the first update (no second pass), the pass's own
cast and autocast run every step, and the caller's kept weights stand for W_0
(actscan.measure.state). The loop itself is `actscan.steps.loop.run_steps`.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from actscan.errors import UsageError
from actscan.measure.profile import Profiled, Progress
from actscan.measure.state import CallerWeights
from actscan.records import Dynamics, ParamRecord, StreamPoint
from actscan.steps.loop import StepSpec, StepsRaw, dynamics_record, run_steps

__all__ = ["steps_record", "take_steps"]


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
    spec, chosen = profiled.spec, profiled.chosen
    return run_steps(
        model,
        steps,
        layout=profiled.layout,
        source=chosen.source,
        step0=profiled.step0,
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
    )


def steps_record(
    raw: StepsRaw | None, stream: Sequence[StreamPoint], params: Sequence[ParamRecord]
) -> Dynamics | None:
    """The report's `dynamics` (None: the run took no steps)."""
    return dynamics_record(raw, stream, params) if raw is not None else None
