"""actscan: does the scale of activations and gradients stay sane through depth?

`from actscan import scan` is the Python API. Heavy modules (torch, transformers) load
lazily so that `actscan --help` and report tooling start fast.
"""

from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["Finding", "LayerRecord", "Report", "Severity", "__version__", "scan"]

if TYPE_CHECKING:
    from actscan.report import Report
    from actscan.scan import scan
    from actscan.types import Finding, LayerRecord, Severity


def __getattr__(name: str) -> Any:
    if name == "scan":
        from actscan.scan import scan

        return scan
    if name == "Report":
        from actscan.report import Report

        return Report
    if name in {"Finding", "LayerRecord", "Severity"}:
        from actscan import types

        return getattr(types, name)
    raise AttributeError(f"module 'actscan' has no attribute {name!r}")


class _Package(types.ModuleType):
    """Keeps `actscan.scan` the function: importing the submodule `actscan.scan` makes the
    import system bind the module object here, which would shadow the API's name."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "scan" and isinstance(value, types.ModuleType):
            value = value.scan
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
