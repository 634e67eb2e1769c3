"""The `actscan` typer app: each command module registers itself on it.

A module of its own so that the command modules import it and the package's
`__init__` imports them: no import cycle.
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
