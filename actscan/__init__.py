"""actscan: does the scale of activations and gradients stay sane through depth?

`from actscan import scan` is the Python API; `scan_target(TargetSpec(...), Settings(...))`
is the path the CLI takes (resolve a target, scan it, apply ignores). Heavy modules
(torch, transformers) load lazily so that `actscan --help` and report tooling start fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from actscan.version import __version__

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
    from actscan.api import TargetSpec, scan_target
    from actscan.records import Finding, LayerRecord, Severity
    from actscan.report.report import Report
    from actscan.run import scan
    from actscan.settings import Ignore, Settings


def __getattr__(name: str) -> Any:
    if name == "scan":
        from actscan.run import scan

        return scan
    if name == "Report":
        from actscan.report.report import Report

        return Report
    if name in {"scan_target", "TargetSpec"}:
        from actscan import api

        return getattr(api, name)
    if name in {"Settings", "Ignore"}:
        from actscan import settings

        return getattr(settings, name)
    if name in {"Finding", "LayerRecord", "Severity"}:
        from actscan import records

        return getattr(records, name)
    raise AttributeError(f"module 'actscan' has no attribute {name!r}")
