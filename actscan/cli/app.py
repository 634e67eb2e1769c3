"""The `actscan` typer app: each command module registers itself on it.

A module of its own so that the command modules import it and the package's
`__init__` imports them: no import cycle.
"""

from __future__ import annotations

import sys
from typing import Any

import typer
from typer.core import TyperGroup

from actscan.version import __version__

# click's UsageError and ClickException, as typer's public BadParameter derives from them
# (whichever click typer runs on: its own copy, or the click package).
_CLICK = {c.__name__: c for c in typer.BadParameter.__mro__}
UsageError: type[Exception] = _CLICK["UsageError"]
ClickException: type[Exception] = _CLICK["ClickException"]


class OneLineErrors(TyperGroup):
    """The app's group: a mistake on the command line itself (an unknown option, a value
    of the wrong type, a missing argument) is one `actscan: error:` line and exit 2, as
    every other mistake is; help, exits and the rest run as click runs them."""

    def main(self, *args: Any, **kwargs: Any) -> Any:
        standalone = kwargs.get("standalone_mode", True)
        kwargs["standalone_mode"] = False  # click's errors come here, not to its printer
        if not standalone:
            return super().main(*args, **kwargs)
        try:
            code = super().main(*args, **kwargs)
        except UsageError as err:
            if type(err).__name__ == "NoArgsIsHelpError":  # the help, asked for by no arguments
                err.show()  # type: ignore[attr-defined]
                sys.exit(getattr(err, "exit_code", 2))
            text = " ".join(err.format_message().split()).rstrip(".")  # type: ignore[attr-defined]
            ctx = getattr(err, "ctx", None)
            where = f"; see {ctx.command_path} --help" if ctx is not None else ""
            print(f"actscan: error: {text}{where}", file=sys.stderr)
            sys.exit(2)
        except ClickException as err:
            err.show()  # type: ignore[attr-defined]
            sys.exit(getattr(err, "exit_code", 1))
        except typer.Abort:
            print("Aborted!", file=sys.stderr)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


app = typer.Typer(
    name="actscan",
    cls=OneLineErrors,
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
