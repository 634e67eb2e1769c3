"""The `actscan` command line. Thin: parse options, call scan(), render, map errors.

Importing this package must not import torch or transformers (`actscan --help` ≤ 0.3 s):
each command imports what it needs when it runs.
"""

from __future__ import annotations

import typer

from actscan.version import __version__

app = typer.Typer(
    name="actscan",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    help=(
        "Does the scale of activations and gradients stay sane through depth?\n\n"
        "One measured forward+backward pass of a PyTorch model: per-module statistics, "
        "the residual stream, and findings with remedies."
    ),
)


def _version(value: bool) -> None:
    if value:
        print(f"actscan {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version."
    ),
) -> None:
    """actscan: activation and gradient scale, before you train."""


from actscan.cli import compare as _compare  # noqa: E402,F401
from actscan.cli import configs as _configs  # noqa: E402,F401  (registers commands)
from actscan.cli import profile as _profile  # noqa: E402,F401
from actscan.cli import sweep as _sweep  # noqa: E402,F401


def main() -> None:
    app()
