"""Checks: pure rules from measurements to findings (theory per check in docs/checks.md).

Each check is a function CheckContext -> list[Finding | Skip] (context.py; the checks are
the other modules of actscan/diagnose/), registered in CHECKS (registry.py) under the check
ids it emits; a check that cannot
run on what was measured returns a Skip with the reason (too few blocks, no backward pass,
not at init, …) rather than nothing, so silence is never read as a pass. `evaluate` runs
them all and sorts the findings worst first, then in CHECK_ORDER (actscan.records: numerics,
measured depth pathologies, per-component, static init last), so the most explanatory
finding leads; `run_checks` gives the findings alone.
Thresholds come from actscan.diagnose.thresholds only.
"""

from __future__ import annotations

from actscan.diagnose.context import Check, CheckContext
from actscan.diagnose.registry import CHECKS, evaluate, run_checks

__all__ = ["CHECKS", "Check", "CheckContext", "evaluate", "run_checks"]
