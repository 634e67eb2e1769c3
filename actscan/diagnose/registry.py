"""The check registry: each check function under the check ids it emits, and the runner.

`evaluate` runs them all and sorts the findings worst first, then in CHECK_ORDER
(actscan.records), so the most explanatory finding leads; `run_checks` gives the findings
alone.
"""

from __future__ import annotations

from actscan.diagnose import (
    attention,
    branches,
    channels,
    depth,
    init,
    lowprec,
    massive,
    numerics,
    steps,
    underflow,
)
from actscan.diagnose.context import Check, CheckContext
from actscan.records import CHECK_ORDER, CheckId, Finding, Skip, finding_order

__all__ = ["CHECKS", "evaluate", "run_checks"]

# The registry: each check function under the check id(s) of the findings it emits.
# Together the keys cover every CheckId once; run_checks orders findings by CHECK_ORDER.
CHECKS: dict[tuple[CheckId, ...], Check] = {
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
    (CheckId.LOW_PRECISION,): lowprec.low_precision,
    (CheckId.UPDATE_SIZE,): steps.update_size,
    (CheckId.AMPLIFICATION,): steps.amplification,
    (CheckId.ATTN_LOGIT_GROWTH,): steps.attn_logit_growth,
    (CheckId.LOGIT_DRIFT,): steps.logit_drift,
    (CheckId.ADAM_EPSILON,): steps.adam_epsilon,
}


def evaluate(ctx: CheckContext) -> tuple[tuple[Finding, ...], tuple[Skip, ...]]:
    """(findings worst first, then in CHECK_ORDER; skipped checks in CHECK_ORDER)."""
    findings: list[Finding] = []
    skips: list[Skip] = []
    for check in CHECKS.values():
        for item in check(ctx):
            if isinstance(item, Skip):
                skips.append(item)
            else:
                findings.append(item)
    findings.sort(key=finding_order)
    rank = {c.value: i for i, c in enumerate(CHECK_ORDER)}
    skips = list({s.check: s for s in sorted(skips, key=lambda s: rank.get(s.check, 99))}.values())
    return tuple(findings), tuple(skips)


def run_checks(ctx: CheckContext) -> tuple[Finding, ...]:
    """Every registered check's findings: worst first, then in CHECK_ORDER."""
    return evaluate(ctx)[0]
