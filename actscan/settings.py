"""Every setting of a run, declared once: the `Settings` dataclass is the table.

Each field of `Settings` is one setting, declared with `setting(...)`: its type, default,
check, help, command-line flag and help panel, and where it applies (the commands
`profile`, `compare`, `sweep`, the project file, `scan()`). Everything else reads the
table (`SETTINGS`, derived from the fields): the CLI builds each command's options from
it (actscan.cli.options.setting_options), the project file's keys and their checks, the
one validation (`Settings.__post_init__`), `--show-config`, and the defaults `scan()`
takes. Adding a setting is one field here and the stage that uses it.

`Settings.resolve` merges command line > `[tool.actscan]` (or `actscan.toml`) > defaults
into one frozen, validated `Settings` that keeps where each value came from.

Discovery works like ruff/pytest: walk up from the start folder to the filesystem root;
in each folder `actscan.toml` is tried first, then `pyproject.toml` (skipped unless it has
a `[tool.actscan]` table); the first hit wins, files are not merged. Keys are kebab-case in
TOML and snake_case in `ProjectConfig.values`:

```toml
[tool.actscan]
fail-on = "warn"
dtype = "bf16"
seq-len = 128
thresholds = { sqrt-growth = 4.0 }
ignore = [
  { check = "dead-branch", layers = "ls\\d", reason = "LayerScale starts at 0 by design" },
]
```
"""

from __future__ import annotations

import difflib
import math
import re
import tomllib
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from enum import Enum
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from actscan.errors import ActscanError, ConfigError, UsageError
from actscan.files import CONFIG_CAP, read_text_bounded
from actscan.records import CheckId, DType, FailOn, Finding

if TYPE_CHECKING:
    from actscan.diagnose.thresholds import Thresholds

__all__ = [
    "COMMANDS",
    "CONFIG",
    "CONFIG_NAMES",
    "PANELS",
    "RUN_KEYS",
    "SCAN",
    "SETTINGS",
    "Ignore",
    "ProjectConfig",
    "Setting",
    "Settings",
    "apply_ignores",
    "effective_settings",
    "find_project_config",
    "load_project_config",
    "parse_ignores",
    "setting",
]

ACTSCAN_TOML = "actscan.toml"
PYPROJECT_TOML = "pyproject.toml"
CONFIG_NAMES = (ACTSCAN_TOML, PYPROJECT_TOML)  # tried in this order in each folder

SOURCE_CLI = "command line"
SOURCE_DEFAULT = "default"
SOURCE_API = "python"  # a value passed to Settings(...) directly
SOURCE_SCAN = "scan()"  # a keyword of scan(): its messages name the CLI flag, as the CLI's do

# Where a setting applies: the three commands, the project file, scan()'s keywords.
PROFILE, COMPARE, SWEEP = "profile", "compare", "sweep"
CONFIG, SCAN = "config", "scan"
COMMANDS = frozenset({PROFILE, COMPARE, SWEEP})
EVERYWHERE = COMMANDS | {CONFIG, SCAN}
# The help panels of the commands' options, in --help order.
PANELS = ("Target", "Inputs", "Precision", "Steps", "Output", "Gate")
# Settings that are tables of their own: merged and checked entry by entry.
THRESHOLDS, IGNORES = "thresholds", "ignores"


# -- checks: each returns the value (normalised) or raises ValueError("must be …") -------
@dataclass(frozen=True)
class OneOf:
    choices: tuple[str, ...]

    def __call__(self, v: Any) -> Any:
        if not isinstance(v, str) or v not in self.choices:
            raise ValueError(f"must be one of {', '.join(self.choices)}, got {v!r}")
        return v

    @property
    def metavar(self) -> str:
        return f"<{'|'.join(self.choices)}>"


@dataclass(frozen=True)
class RunDType(OneOf):
    """A dtype name; from Python also a floating `torch.dtype` (scan(dtype=torch.float64))."""

    def __call__(self, v: Any) -> Any:
        is_torch_dtype = type(v).__module__ == "torch" and type(v).__name__ == "dtype"
        if is_torch_dtype and getattr(v, "is_floating_point", False):
            return v
        return super().__call__(v)


@dataclass(frozen=True)
class ChoiceList(OneOf):
    """A comma-separated list of `choices` ("fp8,nvfp4"), kept in the choices' order
    without repeats; from Python also a list or tuple of them."""

    def __call__(self, v: Any) -> Any:
        items = v.split(",") if isinstance(v, str) else v
        if not isinstance(items, list | tuple) or not items:
            raise ValueError(f"must be a comma-separated list of {', '.join(self.choices)}")
        for item in items:
            super().__call__(item.strip() if isinstance(item, str) else item)
        got = {str(i).strip() for i in items}
        return ",".join(c for c in self.choices if c in got)

    @property
    def metavar(self) -> str:
        return f"<{','.join(self.choices)}>"


@dataclass(frozen=True)
class Integer:
    """An integer in [minimum, maximum]: the maximum is where the number cannot work (a
    size torch cannot hold, a seed its generators refuse), with `why` saying so."""

    minimum: int
    maximum: int
    why: str

    def __call__(self, v: Any) -> Any:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"must be an integer, got {v!r}")
        if v < self.minimum:
            raise ValueError(f"must be at least {self.minimum}, got {v}")
        if v > self.maximum:
            raise ValueError(f"must be at most {self.maximum} ({self.why}), got {v}")
        return v

    @property
    def metavar(self) -> str:
        return f"<int ≥ {self.minimum}>"


@dataclass(frozen=True)
class Number:
    """A finite number, > 0 (`positive`) or ≥ 0, and at most `maximum` (where it can no
    longer work, `why` says how)."""

    positive: bool = False  # > 0; else ≥ 0
    maximum: float = math.inf
    why: str = ""

    def __call__(self, v: Any) -> Any:
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise ValueError(f"must be a finite number, got {v!r}")
        if self.positive and v <= 0:
            raise ValueError(f"must be > 0, got {v!r}")
        if v < 0:
            raise ValueError(f"must be ≥ 0, got {v!r}")
        if v > self.maximum:
            raise ValueError(f"must be at most {self.maximum:g} ({self.why}), got {v!r}")
        return float(v)

    @property
    def metavar(self) -> str:
        return "<float > 0>" if self.positive else "<float ≥ 0>"


# Upper bounds where a number cannot work. Sizes: a batch × sequence of int32 sides keeps
# every tensor's element count in int64. Seeds: scaled by ~1e5 into torch's 64-bit seeds.
SIZE_MAX = 2**31 - 1
SEED_MAX = 2**32 - 1
SIZE = "beyond the size of any tensor"


def boolean(v: Any) -> Any:
    if not isinstance(v, bool):
        raise ValueError(f"must be true or false, got {v!r}")
    return v


def text(v: Any) -> Any:
    if not isinstance(v, str) or not v:
        raise ValueError(f"must be a non-empty string, got {v!r}")
    return v


def regex(v: Any) -> Any:
    if not isinstance(v, str):
        raise ValueError(f"must be a regular expression string, got {v!r}")
    try:
        re.compile(v)
    except re.error as err:
        raise ValueError(f"is an invalid regex {v!r}: {err}") from None
    return v


def betas_pair(v: Any) -> Any:
    ok = isinstance(v, tuple | list) and len(v) == 2
    if not ok or not all(Number()(b) < 1 for b in v):
        raise ValueError(f"must be two numbers in [0, 1), got {v!r}")
    return (float(v[0]), float(v[1]))


def thresholds_table(v: Any) -> Any:
    """A project file's `thresholds`: name = number (names are checked by Settings)."""
    if not isinstance(v, dict):
        raise ValueError(f"must be a table of name = number, got {v!r}")
    out: dict[str, float] = {}
    for name, x in v.items():
        if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x):
            raise ValueError(f"entry {name!r} must be a finite number, got {x!r}")
        out[str(name).replace("_", "-")] = float(x)  # one spelling, so the CLI can override
    return out


def threshold_options(items: list[str] | None) -> dict[str, str] | None:
    """`--threshold NAME=VALUE` (repeatable) into a dict; None when none is given."""
    from actscan.diagnose.thresholds import parse_threshold_options  # loads no torch

    return parse_threshold_options(items) or None


# -- the table's row --------------------------------------------------------------------
_SAME: Any = object()  # scan()'s default is the table's
_ROW = "actscan.setting"  # the field metadata key


@dataclass(frozen=True)
class Setting:
    """One row of the table, read off one field of `Settings`."""

    name: str  # the field (snake_case)
    type: Any  # the field's type
    default: Any
    help: str  # one sentence; `help_text` adds the default
    check: Callable[[Any], Any] | None
    flag: str | None  # the command-line option; a bool's flag sets the opposite of its default
    panel: str | None  # its --help panel (one of PANELS)
    applies: frozenset[str]  # COMMANDS members, CONFIG, SCAN
    key: str  # in the project file (kebab-case)
    scan_name: str  # scan()'s keyword
    scan_default: Any  # scan()'s default, where it differs (device: None = the model's)
    cli_type: Any  # what the option parses, where it is not the field's type
    parse: Callable[[Any], Any] | None  # the option's value → the setting's

    @property
    def optional(self) -> bool:
        return type(None) in typing.get_args(self.type)

    def help_text(self) -> str:
        """The help with its default: "Sequences per batch [4]." (None and flags: none)."""
        if self.default is None or isinstance(self.default, bool | Mapping | tuple):
            return self.help
        return f"{self.help.removesuffix('.')} [{_shown(self.default)}]."

    def validate(self, value: Any, where: str, error: type[ActscanError] = UsageError) -> Any:
        """`value` checked and normalised; `error("<where> must be …")` if it is not."""
        if value is None and self.optional:
            return None
        if self.check is None:
            return value
        try:
            return self.check(value)
        except ValueError as err:
            raise error(f"{where} {err}") from None

    def where(self, source: str) -> str:
        """How a message names this setting, given where its value came from."""
        if source in (SOURCE_CLI, SOURCE_SCAN):
            return self.flag or self.scan_name
        if source in (SOURCE_API, SOURCE_DEFAULT):
            return f"Settings({self.name}=...)"
        return f"{source} {self.key}"


def _shown(v: Any) -> str:
    """A default as the help writes it: 1e-3, 0, adamw."""
    if isinstance(v, float) and v != 0 and abs(v) < 1e-2:
        mantissa, _, exp = f"{v:e}".partition("e")
        return f"{mantissa.rstrip('0').rstrip('.')}e{int(exp)}"
    return f"{v:g}" if isinstance(v, float) else str(v)


def setting(
    default: Any = MISSING,
    *,
    help: str,
    check: Callable[[Any], Any] | None = None,
    flag: str | None = None,
    panel: str | None = None,
    applies: Iterable[str] = EVERYWHERE,
    factory: Callable[[], Any] | None = None,
    key: str | None = None,
    scan_name: str | None = None,
    scan_default: Any = _SAME,
    cli_type: Any = None,
    parse: Callable[[Any], Any] | None = None,
) -> Any:
    """A field of `Settings` that is a setting: `x: int = setting(4, help=..., ...)`.

    `applies` defaults to everywhere (the commands, the project file, scan()); a setting
    with a command among them needs a `flag` and a `panel`.
    """
    row = {
        "help": help,
        "check": check,
        "flag": flag,
        "panel": panel,
        "applies": frozenset(applies),
        "key": key,
        "scan_name": scan_name,
        "scan_default": scan_default,
        "cli_type": cli_type,
        "parse": parse,
    }
    if factory is not None:
        return field(default_factory=factory, metadata={_ROW: row})
    return field(default=default, metadata={_ROW: row})


@dataclass(frozen=True)
class Ignore:
    """Drop findings of `check` (on layers matching `layers`, when given), for `reason`."""

    check: str
    reason: str
    layers: str | None = None

    def matches(self, finding: Finding) -> bool:
        if str(finding.check) != self.check:
            return False
        if self.layers is None:
            return True
        pattern = re.compile(self.layers)
        return any(pattern.search(name) for name in finding.layers)


@dataclass(frozen=True)
class ProjectConfig:
    """The project file that applies (None: none found) and its validated settings.

    `values` has snake_case keys (`fail_on`, `seq_len`, …) and only those the file sets;
    `thresholds` is a dict name → float. The `ignore` entries are in `ignores`.
    """

    path: Path | None
    values: dict[str, Any] = field(default_factory=dict)
    ignores: tuple[Ignore, ...] = ()


# -- the project file -----------------------------------------------------------------
_IGNORE_KEYS = ("check", "layers", "reason")


def _unknown(origin: str | Path, where: str, key: str, known: Iterable[str]) -> ConfigError:
    known = list(known)
    close = difflib.get_close_matches(key.replace("_", "-"), known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f" (known: {', '.join(known)})"
    return ConfigError(f"{origin}: unknown key {key!r} in {where}{hint}")


def parse_ignores(
    raw: Any,
    *,
    origin: str | Path = "scan()",
    key: str = "ignore",
    error: type[ActscanError] = UsageError,
) -> tuple[Ignore, ...]:
    """Validate ignore rules: a list of {check, reason, layers?} tables (or `Ignore`s).

    One parser for `[tool.actscan] ignore` and `scan(ignore=...)`, so both accept and
    refuse the same rules. Errors are `error("<origin>: <key>[i] ...")`, one line.
    """
    if isinstance(raw, Mapping | str | Ignore) or not isinstance(raw, Iterable):
        raise error(f"{origin}: {key} must be a list of tables, got {raw!r}")
    checks = [c.value for c in CheckId]
    out = []
    for i, entry in enumerate(raw):
        at = f"{key}[{i}]"
        if isinstance(entry, Ignore):
            entry = {"check": entry.check, "reason": entry.reason, "layers": entry.layers}
        if not isinstance(entry, Mapping):
            raise error(f"{origin}: {at} must be a table like {{check = ..., reason = ...}}")
        for k in entry:
            if k not in _IGNORE_KEYS:
                raise error(str(_unknown(origin, at, k, _IGNORE_KEYS)))
        check = entry.get("check")
        check = check.value if isinstance(check, Enum) else check
        if not isinstance(check, str):
            raise error(f'{origin}: {at} needs check = "<check id>"')
        if check not in checks:
            raise error(
                f"{origin}: {at} check {check!r} is not a check id (known: {', '.join(checks)})"
            )
        reason = entry.get("reason")
        if not isinstance(reason, str) or not reason.strip():
            raise error(f'{origin}: {at} needs reason = "…" (why {check} is ignored)')
        layers = entry.get("layers")
        if layers is not None:
            try:
                regex(layers)
            except ValueError as err:
                raise error(f"{origin}: {at} layers {err}") from None
        out.append(Ignore(check=check, reason=reason.strip(), layers=layers))
    return tuple(out)


def _config_rows() -> dict[str, Setting]:
    """The project file's keys (but `ignore`, parsed apart) → their rows."""
    return {s.key: s for s in SETTINGS if CONFIG in s.applies and s.name != IGNORES}


def _from_table(path: Path, where: str, table: Mapping[str, Any]) -> ProjectConfig:
    values: dict[str, Any] = {}
    ignores: tuple[Ignore, ...] = ()
    for key, raw in table.items():
        if key == "ignore":
            ignores = parse_ignores(raw, origin=path, key=f"{where} ignore", error=ConfigError)
            continue
        row = _config_rows().get(key)
        if row is None:
            raise _unknown(path, where, key, [*_config_rows(), "ignore"])
        values[row.name] = row.validate(raw, f"{path}: {where} {key}", ConfigError)
    return ProjectConfig(path=path, values=values, ignores=ignores)


def _read_toml(path: Path) -> dict[str, Any]:
    """A project file: a regular file under the config cap (actscan/files.py), TOML."""
    text = read_text_bounded(path, cap=CONFIG_CAP, what="project file", error=ConfigError)
    try:
        return tomllib.loads(text)
    except RecursionError:
        raise ConfigError(f"{path}: invalid TOML: nested too deeply") from None
    except (tomllib.TOMLDecodeError, ValueError) as err:  # ValueError: ints past 4300 digits
        raise ConfigError(f"{path}: invalid TOML: {err}") from None


def _tool_table(path: Path, data: Mapping[str, Any]) -> Mapping[str, Any] | None:
    tool = data.get("tool")
    if not isinstance(tool, dict) or "actscan" not in tool:
        return None
    table = tool["actscan"]
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: [tool.actscan] must be a table")
    return table


def load_project_config(path: str | Path) -> ProjectConfig:
    """Read and validate one project file (`actscan.toml` or a `pyproject.toml`).

    An `actscan.toml` holds the settings at top level or under `[tool.actscan]`. A
    `pyproject.toml` without `[tool.actscan]` gives an empty config for that path.
    Raises ConfigError naming the file and the key on any problem.
    """
    path = Path(path)
    data = _read_toml(path)
    table = _tool_table(path, data)
    if path.name == PYPROJECT_TOML or table is not None:
        if table is not None and path.name != PYPROJECT_TOML:
            others = [k for k in data if k != "tool"] + [k for k in data["tool"] if k != "actscan"]
            if others:
                raise ConfigError(
                    f"{path}: mixes [tool.actscan] with other keys ({', '.join(others)}); "
                    "use one or the other"
                )
        return _from_table(path, "[tool.actscan]", table or {})
    return _from_table(path, "top level", data)


def _pyproject_has_table(path: Path) -> bool:
    # A pyproject.toml that is not meant for us must not break actscan (one we cannot
    # read at all is skipped); a broken one that mentions us is reported by
    # load_project_config.
    try:
        text = read_text_bounded(path, cap=CONFIG_CAP, what="project file", error=ConfigError)
    except ConfigError:
        return False
    try:
        data = tomllib.loads(text)
    except (tomllib.TOMLDecodeError, ValueError, RecursionError):
        return "actscan" in text
    return _tool_table(path, data) is not None


def find_project_config(start: str | Path | None = None) -> ProjectConfig:
    """The project config that applies in `start` (default: the current folder).

    Walks up to the filesystem root; in each folder `actscan.toml` wins over a
    `pyproject.toml` with `[tool.actscan]`; the first hit wins. None found:
    `ProjectConfig(path=None)`.
    """
    folder = Path.cwd() if start is None else Path(start)
    folder = folder.resolve()
    if folder.is_file():
        folder = folder.parent
    for here in (folder, *folder.parents):
        candidate = here / ACTSCAN_TOML
        if candidate.is_file():
            return load_project_config(candidate)
        candidate = here / PYPROJECT_TOML
        if candidate.is_file() and _pyproject_has_table(candidate):
            return load_project_config(candidate)
    return ProjectConfig(path=None)


# -- merging --------------------------------------------------------------------------
def _snake(d: Mapping[str, Any]) -> dict[str, Any]:
    return {k.replace("-", "_"): v for k, v in d.items()}


def effective_settings(
    cli: Mapping[str, Any], project: ProjectConfig, defaults: Mapping[str, Any]
) -> dict[str, tuple[Any, str]]:
    """Each setting's value and where it came from: "command line", the project file's
    path, or "default". Command-line values that are not None win over the file, the
    file over the defaults. Keys are snake_case (kebab-case input is accepted).

    `thresholds` merge per name (command line > file > defaults); the merged dict's
    source lists the contributing sources joined by " + ", and each name also appears as
    `thresholds.<name>` with its own source.
    """
    cli_v, file_v, default_v = _snake(cli), _snake(project.values), _snake(defaults)
    file_src = str(project.path) if project.path is not None else "project config"
    out: dict[str, tuple[Any, str]] = {}
    for key in dict.fromkeys([*default_v, *file_v, *cli_v]):
        if key == "thresholds":
            continue
        if cli_v.get(key) is not None:
            out[key] = (cli_v[key], SOURCE_CLI)
        elif key in file_v:
            out[key] = (file_v[key], file_src)
        else:
            out[key] = (default_v.get(key), SOURCE_DEFAULT)
    if "thresholds" in default_v or "thresholds" in file_v or "thresholds" in cli_v:
        merged: dict[str, Any] = {}
        per_key: dict[str, tuple[Any, str]] = {}
        for layer, src in (
            (default_v.get("thresholds"), SOURCE_DEFAULT),
            (file_v.get("thresholds"), file_src),
            (cli_v.get("thresholds"), SOURCE_CLI),
        ):
            for name, value in (layer or {}).items():
                if value is None:
                    continue
                merged[name] = value
                per_key[name] = (value, src)
        sources = [
            s
            for s in (SOURCE_CLI, file_src, SOURCE_DEFAULT)
            if any(v[1] == s for v in per_key.values())
        ]
        out["thresholds"] = (merged, " + ".join(sources) or SOURCE_DEFAULT)
        for name, entry in per_key.items():
            out[f"thresholds.{name}"] = entry
    return out


def apply_ignores(
    findings: Iterable[Finding], ignores: Iterable[Ignore]
) -> tuple[tuple[Finding, ...], tuple[tuple[Finding, str], ...]]:
    """Split findings into (kept, ignored-with-reason). An ignore matches when the check
    ids are equal and, if it has `layers`, the regex matches (re.search) any of the
    finding's layers. The first matching ignore gives the reason."""
    ignores = tuple(ignores)
    kept: list[Finding] = []
    ignored: list[tuple[Finding, str]] = []
    for f in findings:
        hit = next((ig for ig in ignores if ig.matches(f)), None)
        if hit is None:
            kept.append(f)
        else:
            ignored.append((f, hit.reason))
    return tuple(kept), tuple(ignored)


# -- the table --------------------------------------------------------------------------
def _plain(value: Any) -> Any:
    """Enum members (records.DType, FailOn) as their string values."""
    return value.value if isinstance(value, Enum) else value


_RUN = COMMANDS | {SCAN}  # a run option, not a project default


@dataclass(frozen=True)
class Settings:
    """Every setting of a run, resolved and validated once, with where each came from.

    Each `setting(...)` field is one row of the table (`SETTINGS`). Built by
    `Settings.resolve` (command line > project file > defaults) for the CLI, or directly
    (`Settings(fail_on="warn", batch=2)`) from Python. `thresholds` holds only the
    overrides (kebab-case name → value; `threshold_set()` gives all of them); `ignores`
    are the project's accepted findings; `project` is the file that applied. `sources`
    maps each setting, `thresholds.<name>` and `ignore` to "command line", the project
    file's path, "default" or "python".
    """

    fail_on: str = setting(
        "error",
        check=OneOf(tuple(m.value for m in FailOn)),
        flag="--fail-on",
        panel="Gate",
        applies=COMMANDS | {CONFIG},
        help="Exit 1 on findings at or above this severity.",
    )
    dtype: str | Any | None = setting(  # noqa: RUF009  (Any: scan() may pass a torch.dtype)
        None,
        check=RunDType(tuple(m.value for m in DType)),
        flag="--dtype",
        panel="Precision",
        help="Cast the model and run in this dtype.",
    )
    amp: str | None = setting(
        None,
        check=OneOf((DType.BF16.value, DType.FP16.value)),
        flag="--amp",
        panel="Precision",
        help="Autocast in this dtype with fp32 weights.",
    )
    batch: int = setting(
        4,
        check=Integer(1, SIZE_MAX, SIZE),
        flag="--batch",
        panel="Inputs",
        help="Sequences per batch.",
    )
    seq_len: int | None = setting(
        None,
        check=Integer(1, SIZE_MAX, SIZE),
        flag="--seq-len",
        panel="Inputs",
        help="Tokens per sequence.",
    )
    batches: int = setting(
        1,
        check=Integer(1, 1_000_000, "each batch is a full forward and backward pass"),
        flag="--batches",
        panel="Inputs",
        help="Merge statistics over N batches.",
    )
    seed: int = setting(
        0,
        check=Integer(0, SEED_MAX, "a 32-bit seed"),
        flag="--seed",
        panel="Inputs",
        help="Seed for inputs and init.",
    )
    # read before the model is built (targets/footprint.py); scan() gets a model built
    force: bool = setting(
        False,
        check=boolean,
        flag="--force",
        panel="Target",
        applies=COMMANDS,
        help="Build the model even when its estimated memory exceeds what the machine has.",
    )
    # scan(device=None) runs where the model's weights are; the commands default to auto
    device: str | None = setting(
        "auto",
        check=OneOf(("cpu", "cuda", "auto")),
        flag="--device",
        panel="Precision",
        scan_default=None,
        help="Where to run (auto: cuda when there is one).",
    )
    modules: str | None = setting(
        None,
        check=regex,
        flag="--modules",
        panel="Output",
        help="Record only modules whose name matches REGEX.",
    )
    dropout: bool = setting(
        False,
        check=boolean,
        flag="--dropout",
        panel="Inputs",
        help="Keep dropout on (the run is in train mode; dropout is off by default).",
    )
    # the first optimizer steps (actscan.steps.loop): 0 = the step-0 profile only
    steps: int = setting(
        0,
        check=Integer(0, 100_000, "the first steps of training, each kept in the report"),
        flag="--steps",
        panel="Steps",
        help="Take N optimizer steps and measure each (0: step 0 only).",
    )
    optimizer: str = setting(
        "adamw",
        check=OneOf(("adamw", "adam", "sgd")),
        flag="--optimizer",
        panel="Steps",
        help="The optimizer of --steps.",
    )
    lr: float = setting(
        1e-3,
        check=Number(positive=True, maximum=1e3, why="no model trains at that rate"),
        flag="--lr",
        panel="Steps",
        help="The learning rate you will train with.",
    )
    betas: tuple[float, float] = setting(
        (0.9, 0.95), check=betas_pair, applies={SCAN}, help="Adam's β1, β2 for the steps."
    )
    eps: float = setting(
        1e-8,
        check=Number(positive=True, maximum=1.0, why="above 1 it swamps any gradient's scale"),
        flag="--eps",
        panel="Steps",
        help="Adam's epsilon for --steps.",
    )
    weight_decay: float = setting(
        0.0,
        check=Number(maximum=1e3, why="no model trains under that decay"),
        flag="--weight-decay",
        panel="Steps",
        help="Weight decay for --steps.",
    )
    warmup: int = setting(
        0,
        check=Integer(0, 100_000, "the most --steps allows"),
        flag="--warmup",
        panel="Steps",
        help="Linear learning-rate warmup steps (may exceed --steps: the steps measured are "
        "the first ones of that schedule).",
    )
    attention: bool = setting(
        True,
        check=boolean,
        flag="--no-attention",
        panel="Output",
        help="Switch the attention probes off (per-head scores, entropy, sink; the Heads table).",
    )
    # distributed runs (actscan.distributed.runtime): how long a collective may wait
    dist_timeout: float = setting(
        120.0,
        check=Number(positive=True),
        flag="--dist-timeout",
        panel="Target",
        applies={PROFILE, CONFIG},
        help="Distributed runs: seconds a rank waits for the others in a collective before "
        "naming the ranks that did not respond.",
    )
    backward: bool = setting(
        True,
        check=boolean,
        flag="--no-backward",
        panel="Output",
        applies=_RUN,
        help="Forward only: no gradient statistics.",
    )
    channels: bool = setting(
        True,
        check=boolean,
        applies={SCAN},
        help="Per-channel statistics (outlier channels, dead units); False skips them.",
    )
    # What the model is, as the caller knows it (the CLI's --init/--at-init are target options).
    init: str | None = setting(
        None,
        check=text,
        applies={SCAN},
        help="The --init scheme the model was built with (the report says it).",
    )
    at_init: bool | None = setting(
        None,
        check=boolean,
        applies={SCAN},
        help="Whether the weights are an initialization; None: the resolver's say.",
    )
    # low-precision readiness of every GEMM (actscan.measure.lowprec): off by default
    formats: str | None = setting(
        None,
        check=ChoiceList(("fp8", "mxfp8", "nvfp4")),
        flag="--formats",
        panel="Precision",
        help="Simulate every GEMM's operands in these formats (comma-separated).",
    )
    gemm_error: bool = setting(
        False,
        check=boolean,
        flag="--gemm-error",
        panel="Precision",
        help="With --formats: also each GEMM's output error ‖Q(X)Q(W)ᵀ − XWᵀ‖/‖XWᵀ‖ per "
        "format (a project default: nothing without --formats).",
    )
    thresholds: Mapping[str, float] = setting(
        factory=dict,
        check=thresholds_table,
        flag="--threshold",
        panel="Gate",
        scan_default=None,
        cli_type=list[str],
        parse=threshold_options,
        help="Override a threshold: NAME=VALUE (repeatable).",
    )
    ignores: tuple[Ignore, ...] = setting(
        (),
        key="ignore",
        scan_name="ignore",
        applies={CONFIG, SCAN},
        scan_default=None,
        help="Findings you accept: {check, reason, layers?} rules.",
    )
    # the first operation that breaks (actscan.measure.trace); automatic when the run breaks
    trace: bool = setting(
        False,
        check=boolean,
        flag="--trace",
        panel="Output",
        help="Rerun one batch op by op and name the first operation whose output is inf/nan "
        "or beyond the dtype's range (automatic when the run overflows or diverges).",
    )
    project: Path | None = None
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        """The one validation of every setting: one line per mistake, naming the setting
        as its source knows it (`--batch`, `pyproject.toml batch`, `Settings(batch=...)`)."""
        sources = dict(self.sources)
        for s in SETTINGS:
            if s.name in (THRESHOLDS, IGNORES):
                continue
            value = _plain(getattr(self, s.name))
            src = sources.setdefault(s.name, SOURCE_DEFAULT if value == s.default else SOURCE_API)
            if not (src == SOURCE_DEFAULT and value == s.default):
                value = s.validate(value, s.where(src))
            object.__setattr__(self, s.name, value)
        self._check_together(sources)
        object.__setattr__(self, THRESHOLDS, self._checked_thresholds(sources))
        if self.ignores:
            ignores = parse_ignores(self.ignores, origin=sources.get("ignore", "settings"))
            object.__setattr__(self, IGNORES, ignores)
        elif self.ignores is None:  # scan(ignore=None)
            object.__setattr__(self, IGNORES, ())
        object.__setattr__(self, "sources", MappingProxyType(sources))

    def _check_together(self, sources: Mapping[str, str]) -> None:
        """Settings that are fine alone but not together."""

        def where(name: str) -> str:
            return ROWS[name].where(sources.get(name, SOURCE_API))

        if self.optimizer in ("adamw", "sgd") and self.lr * self.weight_decay >= 1:
            raise UsageError(
                f"{where('weight_decay')} {self.weight_decay:g} × {where('lr')} {self.lr:g} "
                f"is ≥ 1: {self.optimizer} multiplies every weight by 1 − lr·weight-decay "
                "each step, which would zero or flip it"
            )
        if self.steps and not self.backward:
            raise UsageError(f"{where('steps')} needs the backward pass: drop {where('backward')}")

    def _checked_thresholds(self, sources: dict[str, str]) -> Mapping[str, float]:
        """Fail before any model is built on a name or value scan() would refuse, naming
        where it came from; store each as a float under its kebab-case name."""
        from actscan.diagnose.thresholds import DEFAULT

        out: dict[str, float] = {}
        for name, value in (self.thresholds or {}).items():
            kebab = str(name).replace("_", "-")
            where = sources.setdefault(f"thresholds.{kebab}", SOURCE_API)
            try:
                th = DEFAULT.with_overrides({kebab: value})
            except UsageError as err:
                where = "--threshold" if where == SOURCE_CLI else f"{where} [thresholds]"
                raise UsageError(f"{where}: {err}") from None
            out[kebab] = getattr(th, kebab.replace("-", "_"))
        return MappingProxyType(out)

    # -- building --------------------------------------------------------------------
    @classmethod
    def resolve(
        cls, cli: Mapping[str, Any] | None = None, project: ProjectConfig | None = None
    ) -> Settings:
        """Command line (values that are not None) > `project` > defaults.

        `cli` has snake- or kebab-case keys: the settings a command takes (`thresholds` a
        mapping name → value, as `--threshold` gives). `project` None: find the one that
        applies in the current folder.
        """
        project = find_project_config() if project is None else project
        cli = {k.replace("-", "_"): _plain(v) for k, v in (cli or {}).items()}
        if cli.get(THRESHOLDS):  # one spelling per name: the command line overrides the file
            cli[THRESHOLDS] = {k.replace("_", "-"): v for k, v in cli[THRESHOLDS].items()}
        unknown = set(cli) - {s.name for s in SETTINGS if s.applies & COMMANDS}
        if unknown:
            raise TypeError(f"Settings.resolve: unknown keys {sorted(unknown)}")
        defaults = {s.name: s.default for s in SETTINGS if s.applies & (COMMANDS | {CONFIG})}
        eff = effective_settings(cli, project, {k: v for k, v in defaults.items() if k != IGNORES})
        sources = {k: src for k, (_, src) in eff.items()}
        if project.ignores:
            sources["ignore"] = str(project.path)
        values = {k: eff[k][0] for k in defaults if k not in (THRESHOLDS, IGNORES)}
        return cls(
            **values,
            thresholds=eff[THRESHOLDS][0],  # defaults are {}: only file and CLI names
            ignores=project.ignores,
            project=project.path,
            sources=sources,
        )

    @classmethod
    def given(cls, source: str, **values: Any) -> Settings:
        """`values` as `source` gave them (e.g. SOURCE_SCAN: scan()'s keywords, by their
        scan() names), the rest defaults; validated, naming `source` in each message."""
        by_scan = {s.scan_name: s.name for s in SETTINGS}
        named = {by_scan.get(k, k): v for k, v in values.items()}
        sources = {k: source for k in named}
        sources.update({f"thresholds.{k}": source for k in named.get(THRESHOLDS) or {}})
        if named.get(IGNORES):
            sources["ignore"] = source
        return cls(**named, sources=sources)

    # -- reading ---------------------------------------------------------------------
    def source(self, key: str) -> str:
        """Where `key` (a setting, `thresholds.<name>` or `ignore`) came from."""
        key = key if key.startswith("thresholds.") else key.replace("-", "_")
        return self.sources.get(key, SOURCE_DEFAULT)

    def run_values(self) -> dict[str, Any]:
        """The project-file settings by key, in --show-config order (thresholds and ignores
        apart)."""
        return {k: getattr(self, k) for k in RUN_KEYS}

    def threshold_set(self) -> Thresholds:
        """Every threshold: the defaults with this run's overrides (a `Thresholds`)."""
        from actscan.diagnose.thresholds import DEFAULT

        return DEFAULT.with_overrides(dict(self.thresholds))


def _rows() -> tuple[Setting, ...]:
    hints = typing.get_type_hints(Settings)
    out = []
    for f in fields(Settings):
        if _ROW not in f.metadata:
            continue
        row = dict(f.metadata[_ROW])
        default = f.default if f.default_factory is MISSING else f.default_factory()
        row["key"] = row["key"] or f.name.replace("_", "-")
        row["scan_name"] = row["scan_name"] or f.name
        if row["scan_default"] is _SAME:
            row["scan_default"] = default
        s = Setting(name=f.name, type=hints[f.name], default=default, **row)
        if s.applies & COMMANDS and (s.flag is None or s.panel not in PANELS):
            raise TypeError(f"setting {s.name}: a command option needs a flag and a panel")
        out.append(s)
    return tuple(out)


# The table, in declaration order (the order of --show-config and of each help panel).
SETTINGS: tuple[Setting, ...] = _rows()
ROWS: Mapping[str, Setting] = MappingProxyType({s.name: s for s in SETTINGS})
# The project-file settings shown one per row (thresholds and ignores have their own).
RUN_KEYS = tuple(
    s.name for s in SETTINGS if CONFIG in s.applies and s.name not in (THRESHOLDS, IGNORES)
)
