"""The `actscan` command line. Thin: parse options, call scan(), render, map errors.

Importing this package must not import torch or transformers (`actscan --help` ≤ 0.3 s):
each command imports what it needs when it runs. `app` (cli/app.py) is the typer app;
importing the command modules registers their commands on it.
"""

from __future__ import annotations

from actscan.cli import compare as _compare  # noqa: F401  (registers the commands)
from actscan.cli import configs as _configs  # noqa: F401
from actscan.cli import profile as _profile  # noqa: F401
from actscan.cli import sweep as _sweep  # noqa: F401
from actscan.cli.app import app

__all__ = ["app", "main"]


def main() -> None:
    app()
