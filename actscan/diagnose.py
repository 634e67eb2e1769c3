"""Checks: pure rules from measurements to findings (theory in shared/seeds/).

Each check is a function CheckContext -> list[Finding]; `run_checks` runs them all and
sorts the findings worst first. Thresholds come from actscan.thresholds only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from actscan.stats import GrowthFit
from actscan.thresholds import Thresholds
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


def run_checks(ctx: CheckContext) -> tuple[Finding, ...]:
    findings = [f for check in CHECKS.values() for f in check(ctx)]
    findings.sort(key=lambda f: (-f.severity.rank, f.check))
    return tuple(findings)
