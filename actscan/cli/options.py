"""Shared CLI pieces: the commands' options (the settings' built from the table in
actscan.settings, the others declared once here), the error-to-exit-code map, consoles,
report emission. No torch import at module level (`actscan --help` stays fast)."""

from __future__ import annotations

import functools
import inspect
import os
import sys
import traceback
import typing
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ParamSpec, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from typer.models import ArgumentInfo, ParameterInfo

from actscan.errors import (
    MEMORY,
    RUN_ADVICE,
    ActscanError,
    UsageError,
    os_error_text,
    resource_cause,
    resource_kind,
)
from actscan.settings import PANELS, ROWS, SETTINGS, Setting, Settings

if TYPE_CHECKING:
    from actscan.records import Finding
    from actscan.report.report import Report

P = ParamSpec("P")
R = TypeVar("R")

EXIT_OK, EXIT_FINDINGS, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3


class FormatOpt(StrEnum):
    table = "table"
    json = "json"
    markdown = "markdown"
    junit = "junit"


# -- options ------------------------------------------------------------------------------
def option(*decls: str, help: str, panel: str | None = None, **kw: Any) -> Any:
    """A typer option in its help panel. Every option is built here, so its help is
    escaped in one place: rich markup would eat "[4]", "[auto]" and "actscan[plot]"."""
    return typer.Option(*decls, help=escape(help), rich_help_panel=panel, **kw)


def _setting_option(s: Setting) -> inspect.Parameter:
    """The option of one row. A bool's flag sets the opposite of its default; any other
    option defaults to None (not given), so the project file and the defaults apply."""
    assert s.flag is not None
    metavar = getattr(s.check, "metavar", None) if s.cli_type is None else None
    opt = option(s.flag, help=s.help_text(), panel=s.panel, metavar=metavar)
    annotation: Any
    if s.type is bool:
        annotation, default = Annotated[bool, opt], False
    else:
        types = typing.get_args(s.type) or (s.type,)
        base = s.cli_type or next(t for t in types if t is not type(None))
        annotation, default = Annotated[base | None, opt], None
    kind = inspect.Parameter.KEYWORD_ONLY
    return inspect.Parameter(s.name, kind, default=default, annotation=annotation)


def _given(s: Setting, raw: Any) -> Any:
    """An option's value as the setting's value; None when the option was not given."""
    if s.type is bool:
        return (not s.default) if raw else None
    if raw is None or s.parse is None:
        return raw
    return s.parse(raw)


def _place(p: inspect.Parameter) -> int:
    """Where a parameter goes in --help: arguments first, then the options panel by panel
    (PANELS), then options without a panel."""
    meta = getattr(p.annotation, "__metadata__", ())
    info = next((m for m in meta if isinstance(m, ParameterInfo)), None)
    if isinstance(info, ArgumentInfo):
        return -1
    panel = getattr(info, "rich_help_panel", None)
    return PANELS.index(panel) if panel in PANELS else len(PANELS)


def setting_options(command: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give the command an option for every setting of actscan.settings' table that
    applies to `command`; it receives their values resolved (command line > project file
    > defaults, validated once) as its `settings` parameter. Its own parameters stay as
    declared; in --help a panel lists the settings first, then the command's own options.
    """
    rows = [s for s in SETTINGS if command in s.applies]

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        hints = typing.get_type_hints(fn, include_extras=True)
        own = [
            p.replace(annotation=hints.get(p.name, p.annotation), kind=p.KEYWORD_ONLY)
            for p in inspect.signature(fn).parameters.values()
            if p.name != "settings"
        ]
        params = sorted([*map(_setting_option, rows), *own], key=_place)  # stable: table order
        # settings first within a panel: they were listed before the command's own

        @functools.wraps(fn)
        def wrapper(**kwargs: Any) -> Any:
            given = {s.name: _given(s, kwargs.pop(s.name)) for s in rows}
            try:
                settings = Settings.resolve(given)
            except ActscanError as err:  # under a launcher, rank 0 says it once
                raise fail(str(err), err.exit_code, rank0=True) from None
            return fn(settings=settings, **kwargs)

        # typer reads the signature; typeshed does not declare __signature__ on functions
        wrapper.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        wrapper.__annotations__ = {p.name: p.annotation for p in params}
        return wrapper

    return decorate


# The command's own options, each declared once here (profile, compare and sweep share
# them). Target: what to build; the settings' options come from the table.
ConfigOpt = Annotated[
    Path | None,
    option("--config", help="Architecture for a bare .safetensors file.", panel="Target"),
]
Init = Annotated[
    str | None,
    option("--init", help="Re-initialize: gpt2|xavier|kaiming|fan-in|small.", panel="Target"),
]
SetOpt = Annotated[
    list[str] | None,
    option("--set", help="Override a config field: key=value (repeatable).", panel="Target"),
]
AllowNonfinite = Annotated[
    bool,
    option("--allow-nonfinite", help="Run even if weights contain NaN/Inf.", panel="Target"),
]
AtInit = Annotated[
    bool | None,
    option(
        "--at-init/--trained",
        help="Judge the weights as an initialization (init-scale runs) or as trained. "
        "Default: at init for configs and module:callable, trained for checkpoints.",
        panel="Target",
    ),
]
NProc = Annotated[
    int | None,
    option(
        "--nproc",
        min=1,
        help="Run as N processes on this host (torchrun; FSDP2-sharded model, batch split).",
        panel="Target",
    ),
]
InputFile = Annotated[
    Path | None,
    option(
        "--input",
        help="Token ids (.json list of lists) or text (.txt) to run on.",
        panel="Inputs",
    ),
]
InputShape = Annotated[
    str | None,
    option("--input-shape", help="Random float input of this shape, e.g. 4,32.", panel="Inputs"),
]
JsonOut = Annotated[
    str | None,
    option("--json", help="Write the JSON report to PATH ('-' = stdout).", panel="Output"),
]
Format = Annotated[
    FormatOpt, option("--format", help="Output format for stdout or -o.", panel="Output")
]
Output = Annotated[
    str | None, option("-o", "--output", help="Write --format output to PATH.", panel="Output")
]
Quiet = Annotated[bool, option("--quiet", "-q", help="Print only the findings.", panel="Output")]
Plot = Annotated[
    str | None,
    option("--plot", help="Draw stream RMS vs k to PATH (.png/.svg/.pdf).", panel="Output"),
]
# B's side of compare and sweep: what changes from A (checked as A's dtype and amp are).
VsDType = Annotated[
    str | None,
    option(
        "--vs-dtype",
        help="B runs in this dtype (same weights).",
        panel="Precision",
        metavar=getattr(ROWS["dtype"].check, "metavar", None),
    ),
]
VsAmp = Annotated[
    str | None,
    option(
        "--vs-amp",
        help="B autocasts to this dtype.",
        panel="Precision",
        metavar=getattr(ROWS["amp"].check, "metavar", None),
    ),
]
VsInit = Annotated[
    str | None, option("--vs-init", help="B re-initializes with SCHEME.", panel="Target")
]
VsSet = Annotated[
    list[str] | None,
    option(
        "--vs-set",
        help="Override a config field for B only: key=value (repeatable).",
        panel="Target",
    ),
]
VsConfig = Annotated[Path | None, option("--vs-config", help="--config for B.", panel="Target")]


# -- errors -------------------------------------------------------------------------------
def debug() -> bool:
    return os.environ.get("ACTSCAN_DEBUG", "") not in ("", "0")


def fail(message: str, code: int = EXIT_USAGE, *, rank0: bool = False) -> typer.Exit:
    """Print the one line and give the exit. `rank0`: before a distributed run's session
    starts, only rank 0 of a launcher's processes prints it."""
    if not rank0 or os.environ.get("RANK", "0") == "0":
        print(f"actscan: error: {message}", file=sys.stderr)
    return typer.Exit(code)


def handle_errors(fn: Callable[P, R]) -> Callable[P, R]:
    """One clear line and a distinct exit code for every failure; traceback on request."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except typer.Exit:
            raise
        except ActscanError as err:
            if debug():
                traceback.print_exc()
            raise fail(str(err), err.exit_code) from None
        except KeyboardInterrupt:
            raise fail("interrupted", 130) from None
        except Exception as err:  # a bug, a resource limit, or the model's own error
            if debug():
                traceback.print_exc()
            if (line := limit_line(err)) is not None:
                raise fail(line, EXIT_USAGE) from None  # the machine's limits, not actscan
            if (line := _model_error_line(err)) is not None:
                raise fail(line, EXIT_USAGE) from None  # the user's model, not actscan
            msg = str(err).strip().splitlines()[0] if str(err).strip() else ""
            raise fail(
                f"internal error (a bug in actscan, please report it): {type(err).__name__}: "
                f"{msg} (set ACTSCAN_DEBUG=1 for a traceback)",
                EXIT_INTERNAL,
            ) from None

    return wrapper


def limit_line(err: BaseException) -> str | None:
    """The one line for what the machine or the file system refused, wherever it was hit:
    a resource limit (memory, a size torch cannot hold) or an OSError on a path (a name
    too long, no permission, a symlink loop, a full disk). None for anything else."""
    if resource_kind(err) is not None:
        return f"{resource_cause(err)}: {RUN_ADVICE[resource_kind(err) or MEMORY]}"
    if isinstance(err, OSError) and err.errno is not None:
        where = f"{os.fsdecode(err.filename)}: " if err.filename is not None else ""
        return f"{where}{os_error_text(err)}"
    return None


def _model_error_line(err: BaseException) -> str | None:
    """The one line for an error raised by the user's model (scan marks those)."""
    from actscan.measure.prepare import model_error_line

    return model_error_line(err)


def refuse_distributed(command: str) -> None:
    """compare and sweep run in one process: under torchrun, one line (rank 0) and exit 2."""
    from actscan.distributed.launch import launched

    if launched():
        if os.environ.get("RANK", "0") == "0":
            line = (
                f"actscan: error: {command} does not run distributed: profile each model "
                "with `actscan profile --nproc N --json FILE` instead"
            )
            print(line, file=sys.stderr)
        raise typer.Exit(EXIT_USAGE)


# -- consoles -----------------------------------------------------------------------------
def make_console(stderr: bool = False, width: int | None = None) -> Console:
    """Plain text when NO_COLOR is set or the stream is not a terminal."""
    stream = sys.stderr if stderr else sys.stdout
    plain = "NO_COLOR" in os.environ or not stream.isatty()
    return Console(
        file=stream,
        no_color=plain,
        color_system=None if plain else "auto",
        highlight=False,
        width=width or (120 if plain else None),
        soft_wrap=False,
    )


class ProgressSink:
    """A transient progress bar on stderr, only when stderr is an interactive terminal."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and sys.stderr.isatty() and "NO_COLOR" not in os.environ
        self._progress: Any = None
        self._task: Any = None

    def __enter__(self) -> ProgressSink:
        if self.enabled:
            from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn

            self._progress = Progress(
                SpinnerColumn(),
                TextColumn("{task.description}"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total}"),
                transient=True,
                console=Console(file=sys.stderr),
            )
            self._progress.__enter__()
        return self

    def stage(self, text: str) -> None:
        if self._progress is not None:
            if self._task is None:
                self._task = self._progress.add_task(text, total=None)
            else:
                self._progress.update(self._task, description=text)

    def __call__(self, stage: str, done: int, total: int) -> None:
        if self._progress is not None:
            if self._task is None:
                self._task = self._progress.add_task(stage, total=total)
            self._progress.update(
                self._task, description=f"measuring ({stage})", completed=done, total=total
            )

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.__exit__(*exc)


# -- outputs ----------------------------------------------------------------------------
def check_outputs(
    fmt: FormatOpt, output: str | None, json_path: str | None, plot: str | None = None
) -> None:
    """Every output path of a command, checked before any work is done: combinations that
    would mix two documents in one stream or file (stdout must stay parseable), and each
    path that is not a regular file actscan may write (`check_writable`, `check_plot`)."""
    from actscan.report.output import check_writable

    if fmt is not FormatOpt.table and json_path == "-" and output in (None, "-"):
        raise UsageError(
            f"--json - and --format {fmt.value} both write to stdout: give one of them a file "
            "(--json PATH or -o PATH)"
        )
    if (
        json_path not in (None, "-")
        and output not in (None, "-")
        and Path(json_path).resolve() == Path(output).resolve()
    ):
        raise UsageError(f"--json and -o name the same file: {output}")
    for path in (json_path, output):  # fail now, not after a long scan
        if path is not None:
            check_writable(path)
    if plot is not None:
        from actscan.render.plot import check_plot

        check_plot(plot)


def parse_shape(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        shape = tuple(int(s) for s in text.replace("x", ",").split(",") if s.strip())
    except ValueError:
        raise UsageError(f"--input-shape expects comma-separated ints, got '{text}'") from None
    if not shape or any(s < 1 for s in shape):
        raise UsageError(f"--input-shape expects positive ints, got '{text}'")
    return shape


def emit(
    reports: list[Report],
    *,
    fmt: FormatOpt,
    output: str | None,
    json_path: str | None,
    fail_on: str,
    render: Callable[[Console], None],
    quiet: bool,
    json_text: Callable[[], str] | None = None,
    markdown_text: Callable[[], str] | None = None,
    junit_text: Callable[[], str] | None = None,
) -> None:
    """Write --json, --format/-o, and the human table, keeping stdout clean for data.
    `json_text`, `markdown_text`, `junit_text`: a command whose document is more than its
    reports (a sweep's coordinate check) writes its own."""
    from actscan.render.formats import to_junit, to_markdown
    from actscan.report.output import write_atomic

    check_outputs(fmt, output, json_path)
    data_to_stdout = json_path == "-" or (fmt is not FormatOpt.table and output in (None, "-"))
    jt = json_text or (lambda: reports[0].to_json())
    if json_path is not None:
        write_atomic(json_path, jt() + "\n") if json_path != "-" else print(jt())
    if fmt is FormatOpt.table:
        if output not in (None, "-"):
            import io

            buf = io.StringIO()
            render(Console(file=buf, width=120, color_system=None, no_color=True))
            write_atomic(output, buf.getvalue())
        else:
            render(make_console(stderr=data_to_stdout))
        return
    text = {
        FormatOpt.json: lambda: jt() + "\n",
        FormatOpt.markdown: markdown_text
        or (lambda: "\n\n".join(to_markdown(r, fail_on=fail_on) for r in reports)),
        FormatOpt.junit: junit_text or (lambda: to_junit(reports, fail_on=fail_on)),
    }[fmt]()
    if output in (None, "-"):
        sys.stdout.write(text)
        if not quiet:
            render(make_console(stderr=True))
    else:
        write_atomic(output, text)
        render(make_console(stderr=data_to_stdout))


def gate_exit(findings: list[Finding] | tuple[Finding, ...], fail_on: str) -> int:
    from actscan.records import FailOn

    gate = FailOn(fail_on)
    return EXIT_FINDINGS if any(gate.trips(f.severity) for f in findings) else EXIT_OK
