"""actscan: does the scale of activations and gradients stay sane through depth?

`from actscan import scan` is the Python API; `scan_target(TargetSpec(...), Settings(...))`
is the path the CLI takes (resolve a target, scan it, apply ignores). Heavy modules
(torch, transformers) load lazily so that `actscan --help` and report tooling start fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = [
    "Finding",
    "Ignore",
    "LayerRecord",
    "Report",
    "Settings",
    "Severity",
    "TargetSpec",
    "__version__",
    "scan",
    "scan_target",
]

if TYPE_CHECKING:
    from actscan.pipeline import TargetSpec, scan_target
    from actscan.report.report import Report
    from actscan.scanner import scan
    from actscan.settings import Ignore, Settings
    from actscan.types import Finding, LayerRecord, Severity


def __getattr__(name: str) -> Any:
    if name == "scan":
        from actscan.scanner import scan

        return scan
    if name == "Report":
        from actscan.report.report import Report

        return Report
    if name in {"scan_target", "TargetSpec"}:
        from actscan import pipeline

        return getattr(pipeline, name)
    if name in {"Settings", "Ignore"}:
        from actscan import settings

        return getattr(settings, name)
    if name in {"Finding", "LayerRecord", "Severity"}:
        from actscan import types

        return getattr(types, name)
    raise AttributeError(f"module 'actscan' has no attribute {name!r}")
