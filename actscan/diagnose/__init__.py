"""Checks: pure rules from measurements to findings (theory per check in docs/checks.md).

Each check is a function CheckContext -> list[Finding | Skip] (the other modules of
actscan/diagnose/), registered in CHECKS under the check ids it emits; a check that cannot
run on what was measured returns a Skip with the reason (too few blocks, no backward pass,
not at init, …) rather than nothing, so silence is never read as a pass. `evaluate` runs
them all and sorts the findings worst first, then in CHECK_ORDER (actscan.records: numerics,
measured depth pathologies, per-component, static init last), so the most explanatory
finding leads; `run_checks` gives the findings alone.
Thresholds come from actscan.diagnose.thresholds only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from actscan.diagnose.thresholds import Thresholds
from actscan.records import (
    CHECK_ORDER,
    AttentionRecord,
    CheckId,
    Dynamics,
    Finding,
    LayerRecord,
    Layout,
    ModelInfo,
    ParamRecord,
    RunInfo,
    Skip,
    StreamPoint,
    StreamRecord,
    finding_order,
)

if TYPE_CHECKING:  # annotation only: measure.stats imports diagnose.thresholds
    from actscan.measure.stats import GrowthFit


@dataclass(frozen=True)
class CheckContext:
    info: ModelInfo
    run: RunInfo
    layout: Layout
    layers: tuple[LayerRecord, ...]
    stream: tuple[StreamPoint, ...]
    fit: GrowthFit
    params: tuple[ParamRecord, ...]
    thresholds: Thresholds
    # Every residual stream when there are several (encoder-decoder): `stream` and `fit`
    # are then the primary (decoder) one's, and the depth checks run on each in turn.
    streams: tuple[StreamRecord, ...] = ()
    # the first optimizer steps, when the run took any (`--steps N`); None: step 0 only
    dynamics: Dynamics | None = None
    # per attention layer and head (attention probes); empty when off or not available
    attention: tuple[AttentionRecord, ...] = ()


Check = Callable[[CheckContext], "list[Finding | Skip]"]

# The registry: each check function under the check id(s) of the findings it emits.
# Together the keys cover every CheckId once; run_checks orders findings by CHECK_ORDER.
CHECKS: dict[tuple[CheckId, ...], Check] = {}


def _register() -> None:
    from actscan.diagnose import (
        attention,
        branches,
        channels,
        depth,
        init,
        massive,
        numerics,
        steps,
        underflow,
    )

    CHECKS.update(
        {
            (CheckId.OVERFLOW,): numerics.overflow,
            (CheckId.UNDERFLOW,): underflow.underflow,
            (CheckId.EXP_GROWTH, CheckId.COLLAPSE): depth.exp_growth_collapse,
            (CheckId.SQRT_GROWTH,): depth.sqrt_growth,
            (CheckId.VANISHING_GRAD, CheckId.EXPLODING_GRAD): depth.gradients,
            (CheckId.DEAD_BRANCH,): branches.dead_branch,
            (CheckId.DEAD_UNITS,): channels.dead_units,
            (CheckId.OUTLIER_CHANNELS,): channels.outlier_channels,
            (CheckId.MASSIVE_ACTIVATIONS,): massive.massive_activations,
            (CheckId.LOGIT_SCALE,): numerics.logit_scale,
            (CheckId.ATTN_ENTROPY,): attention.attn_entropy,
            (CheckId.INIT_SCALE,): init.init_scale,
            (CheckId.UPDATE_SIZE,): steps.update_size,
            (CheckId.AMPLIFICATION,): steps.amplification,
            (CheckId.ATTN_LOGIT_GROWTH,): steps.attn_logit_growth,
            (CheckId.LOGIT_DRIFT,): steps.logit_drift,
            (CheckId.ADAM_EPSILON,): steps.adam_epsilon,
        }
    )


_register()


def evaluate(ctx: CheckContext) -> tuple[tuple[Finding, ...], tuple[Skip, ...]]:
    """(findings worst first, then in CHECK_ORDER; skipped checks in CHECK_ORDER)."""
    findings: list[Finding] = []
    skips: list[Skip] = []
    for check in CHECKS.values():
        for item in check(ctx):
            (skips if isinstance(item, Skip) else findings).append(item)  # type: ignore[arg-type]
    findings.sort(key=finding_order)
    rank = {c.value: i for i, c in enumerate(CHECK_ORDER)}
    skips = list({s.check: s for s in sorted(skips, key=lambda s: rank.get(s.check, 99))}.values())
    return tuple(findings), tuple(skips)


def run_checks(ctx: CheckContext) -> tuple[Finding, ...]:
    """Every registered check's findings: worst first, then in CHECK_ORDER."""
    return evaluate(ctx)[0]
