"""Shared CLI pieces: every option alias (declared once, used by profile/compare/sweep),
the error-to-exit-code map, consoles, settings resolution, report emission.
No torch import at module level (`actscan --help` stays fast)."""

from __future__ import annotations

import functools
import os
import sys
import traceback
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer
from rich.console import Console

from actscan.errors import ActscanError, UsageError

if TYPE_CHECKING:
    from actscan.records import Finding
    from actscan.report.report import Report
    from actscan.settings import Settings

F = TypeVar("F", bound=Callable[..., Any])

EXIT_OK, EXIT_FINDINGS, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3


class DTypeOpt(StrEnum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class AmpOpt(StrEnum):
    bf16 = "bf16"
    fp16 = "fp16"


class FailOnOpt(StrEnum):
    info = "info"
    warn = "warn"
    error = "error"
    never = "never"


class FormatOpt(StrEnum):
    table = "table"
    json = "json"
    markdown = "markdown"
    junit = "junit"


class DeviceOpt(StrEnum):
    cpu = "cpu"
    cuda = "cuda"
    auto = "auto"


# -- shared option aliases (huggingface_hub style) -------------------------------------
ConfigOpt = Annotated[
    Path | None, typer.Option("--config", help="Architecture for a bare .safetensors file.")
]
DType = Annotated[
    DTypeOpt | None, typer.Option("--dtype", help="Cast the model and run in this dtype.")
]
Amp = Annotated[
    AmpOpt | None, typer.Option("--amp", help="Autocast in this dtype with fp32 weights.")
]
Init = Annotated[
    str | None,
    typer.Option("--init", help="Re-initialize: gpt2|xavier|kaiming|fan-in|small."),
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", help="Override a config field: key=value (repeatable)."),
]
BatchOpt = Annotated[int | None, typer.Option("--batch", min=1, help="Sequences per batch [4].")]
SeqLen = Annotated[int | None, typer.Option("--seq-len", min=1, help="Tokens per sequence.")]
Batches = Annotated[
    int | None, typer.Option("--batches", min=1, help="Merge statistics over N batches [1].")
]
Seed = Annotated[int | None, typer.Option("--seed", min=0, help="Seed for inputs and init [0].")]
InputFile = Annotated[
    Path | None,
    typer.Option("--input", help="Token ids (.json list of lists) or text (.txt) to run on."),
]
Device = Annotated[DeviceOpt | None, typer.Option("--device", help="cpu|cuda|auto [auto].")]
Modules = Annotated[
    str | None, typer.Option("--modules", help="Record only modules whose name matches REGEX.")
]
DropoutFlag = Annotated[
    bool,
    typer.Option(
        "--dropout", help="Keep dropout on (the run is in train mode; dropout is off by default)."
    ),
]
NoAttention = Annotated[
    bool,
    typer.Option(
        "--no-attention",
        help="Switch the attention probes off (per-head scores, entropy, sink; the Heads table).",
    ),
]
NoBackward = Annotated[
    bool, typer.Option("--no-backward", help="Forward only: no gradient statistics.")
]
# The first optimizer steps (checked in Settings: a bad value is one line, exit 2).
StepsOpt = Annotated[
    int | None,
    typer.Option("--steps", help="Take N optimizer steps and measure each (0: step 0 only) [0]."),
]
LrOpt = Annotated[
    float | None, typer.Option("--lr", help="The learning rate you will train with [1e-3].")
]
OptimizerOpt = Annotated[
    str | None, typer.Option("--optimizer", help="adamw|adam|sgd for --steps [adamw].")
]
EpsOpt = Annotated[float | None, typer.Option("--eps", help="Adam's epsilon for --steps [1e-8].")]
WeightDecayOpt = Annotated[
    float | None, typer.Option("--weight-decay", help="Weight decay for --steps [0].")
]
WarmupOpt = Annotated[
    int | None, typer.Option("--warmup", help="Linear learning-rate warmup steps [0].")
]
JsonOut = Annotated[
    str | None, typer.Option("--json", help="Write the JSON report to PATH ('-' = stdout).")
]
Format = Annotated[FormatOpt, typer.Option("--format", help="Output format for stdout or -o.")]
Output = Annotated[
    str | None, typer.Option("-o", "--output", help="Write --format output to PATH.")
]
FailOn = Annotated[
    FailOnOpt | None,
    typer.Option("--fail-on", help="Exit 1 on findings at or above this severity [error]."),
]
InputShape = Annotated[
    str | None,
    typer.Option("--input-shape", help="Random float input of this shape, e.g. 4,32."),
]
ThresholdOpt = Annotated[
    list[str] | None,
    typer.Option("--threshold", help="Override a threshold: NAME=VALUE (repeatable)."),
]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="Print only the findings.")]
NProc = Annotated[
    int | None,
    typer.Option(
        "--nproc", min=1,
        help="Run as N processes on this host (torchrun; FSDP2-sharded model, batch split).",
    ),
]  # fmt: skip
AllowNonfinite = Annotated[
    bool, typer.Option("--allow-nonfinite", help="Run even if weights contain NaN/Inf.")
]
AtInit = Annotated[
    bool | None,
    typer.Option(
        "--at-init/--trained",
        help="Judge the weights as an initialization (init-scale runs) or as trained. "
        "Default: at init for configs and module:callable, trained for checkpoints.",
    ),
]
Plot = Annotated[
    str | None, typer.Option("--plot", help="Draw stream RMS vs k to PATH (.png/.svg/.pdf).")
]
# B's side of compare and sweep: what changes from A.
VsDType = Annotated[
    DTypeOpt | None, typer.Option("--vs-dtype", help="B runs in this dtype (same weights).")
]
VsAmp = Annotated[AmpOpt | None, typer.Option("--vs-amp", help="B autocasts to this dtype.")]
VsInit = Annotated[str | None, typer.Option("--vs-init", help="B re-initializes with SCHEME.")]
VsSet = Annotated[
    list[str] | None,
    typer.Option("--vs-set", help="Override a config field for B only: key=value (repeatable)."),
]
VsConfig = Annotated[Path | None, typer.Option("--vs-config", help="--config for B.")]


# -- errors -------------------------------------------------------------------------------
def debug() -> bool:
    return os.environ.get("ACTSCAN_DEBUG", "") not in ("", "0")


def fail(message: str, code: int = EXIT_USAGE) -> typer.Exit:
    print(f"actscan: error: {message}", file=sys.stderr)
    return typer.Exit(code)


def handle_errors(fn: F) -> F:
    """One clear line and a distinct exit code for every failure; traceback on request."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
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
        except MemoryError:
            raise fail("out of memory: try a smaller --batch/--seq-len or --dtype bf16") from None
        except Exception as err:  # a bug, or a model that raised during forward
            if debug():
                traceback.print_exc()
            if (line := _model_error_line(err)) is not None:
                raise fail(line, EXIT_USAGE) from None  # the user's model, not actscan
            msg = str(err).strip().splitlines()[0] if str(err).strip() else ""
            raise fail(
                f"internal error (a bug in actscan, please report it): {type(err).__name__}: "
                f"{msg} (set ACTSCAN_DEBUG=1 for a traceback)",
                EXIT_INTERNAL,
            ) from None

    return wrapper  # type: ignore[return-value]


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
        file=stream, no_color=plain, color_system=None if plain else "auto", highlight=False,
        width=width or (120 if plain else None), soft_wrap=False,
    )  # fmt: skip


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
                SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                TextColumn("{task.completed}/{task.total}"), transient=True,
                console=Console(file=sys.stderr),
            )  # fmt: skip
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


# -- settings -----------------------------------------------------------------------------
def resolve_settings(
    *,
    fail_on: FailOnOpt | None,
    dtype: DTypeOpt | None,
    amp: AmpOpt | None,
    batch: int | None,
    seq_len: int | None,
    batches: int | None,
    seed: int | None,
    device: DeviceOpt | None,
    modules: str | None,
    threshold: list[str] | None,
    dropout: bool = False,
    steps: int | None = None,
    optimizer: str | None = None,
    lr: float | None = None,
    eps: float | None = None,
    weight_decay: float | None = None,
    warmup: int | None = None,
    no_backward: bool = False,
    no_attention: bool = False,
) -> Settings:
    """The shared run options (None: not given) > [tool.actscan] > defaults, validated."""
    from actscan.diagnose.thresholds import parse_threshold_options
    from actscan.settings import Settings

    settings = Settings.resolve(
        {
            "fail_on": fail_on, "dtype": dtype, "amp": amp, "batch": batch, "seq_len": seq_len,
            "batches": batches, "seed": seed, "device": device, "modules": modules,
            "dropout": True if dropout else None, "steps": steps, "optimizer": optimizer,
            "lr": lr, "eps": eps, "weight_decay": weight_decay, "warmup": warmup,
            "attention": False if no_attention else None,
            "thresholds": parse_threshold_options(threshold) or None,
        }
    )  # fmt: skip
    if no_backward and settings.steps:
        raise UsageError("--steps needs the backward pass: drop --no-backward")
    return settings


def check_outputs(fmt: FormatOpt, output: str | None, json_path: str | None) -> None:
    """Refuse output combinations that would mix two documents in one stream or file,
    before any work is done (stdout must stay parseable)."""
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
        if path not in (None, "-") and not Path(path).absolute().parent.is_dir():
            raise UsageError(f"cannot write {path}: folder {Path(path).parent} does not exist")


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
