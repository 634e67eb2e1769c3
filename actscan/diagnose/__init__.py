"""Checks: pure rules from measurements to findings (theory per check in docs/checks.md).

Each check is a function CheckContext -> list[Finding] (the other modules of
actscan/diagnose/); `run_checks` runs them all and sorts the findings worst first, then in
CHECK_ORDER (numerics, measured depth pathologies, per-component, static init last),
so the most explanatory finding leads.
Thresholds come from actscan.diagnose.thresholds only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from actscan.diagnose.thresholds import Thresholds
from actscan.measure.stats import GrowthFit
from actscan.types import Finding, LayerRecord, Layout, ModelInfo, ParamRecord, RunInfo, StreamPoint


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


Check = Callable[[CheckContext], list[Finding]]
CHECKS: dict[str, Check] = {}


def _register() -> None:
    from actscan.diagnose import branches, channels, depth, init, numerics

    CHECKS.update(
        {
            "overflow": numerics.overflow,
            "exp-growth/collapse": depth.exp_growth_collapse,
            "sqrt-growth": depth.sqrt_growth,
            "vanishing/exploding-grad": depth.gradients,
            "dead-branch": branches.dead_branch,
            "dead-units": channels.dead_units,
            "outlier-channels": channels.outlier_channels,
            "logit-scale": numerics.logit_scale,
            "init-scale": init.init_scale,
        }
    )


_register()


def run_checks(ctx: CheckContext) -> tuple[Finding, ...]:
    from actscan.diagnose.common import CHECK_ORDER

    rank = {c: i for i, c in enumerate(CHECK_ORDER)}
    findings = [f for check in CHECKS.values() for f in check(ctx)]
    findings.sort(key=lambda f: (-f.severity.rank, rank.get(f.check, len(rank))))
    return tuple(findings)
