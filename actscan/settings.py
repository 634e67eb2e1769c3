"""Settings, resolved once: command line > `[tool.actscan]` (or `actscan.toml`) > defaults.

`Settings.resolve` merges the three sources into one frozen, validated `Settings` that
keeps where each value came from (for `--show-config`); `profile`, `compare`, `sweep` and
the library entry point (actscan.api) all read that one object.

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
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from actscan.errors import ActscanError, ConfigError, UsageError
from actscan.records import CheckId, DType, FailOn, Finding

if TYPE_CHECKING:
    from actscan.diagnose.thresholds import Thresholds

__all__ = [
    "CONFIG_NAMES",
    "DEFAULTS",
    "RUN_KEYS",
    "Ignore",
    "ProjectConfig",
    "Settings",
    "apply_ignores",
    "effective_settings",
    "find_project_config",
    "load_project_config",
    "parse_ignores",
]

ACTSCAN_TOML = "actscan.toml"
PYPROJECT_TOML = "pyproject.toml"
CONFIG_NAMES = (ACTSCAN_TOML, PYPROJECT_TOML)  # tried in this order in each folder

SOURCE_CLI = "command line"
SOURCE_DEFAULT = "default"
SOURCE_API = "python"  # a value passed to Settings(...) directly
SOURCE_SCAN = "scan()"  # scan()'s keywords: checked by actscan.run.check_settings instead

# The run settings a project file or the command line can set, in --show-config order.
RUN_KEYS = (
    "fail_on", "dtype", "amp", "batch", "seq_len", "batches", "seed", "device", "modules",
    "dropout", "steps", "optimizer", "lr", "eps", "weight_decay", "warmup", "attention",
)  # fmt: skip
DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {
        "fail_on": "error", "dtype": None, "amp": None, "batch": 4, "seq_len": None,
        "batches": 1, "seed": 0, "device": "auto", "modules": None, "dropout": False,
        "steps": 0, "optimizer": "adamw", "lr": 1e-3, "eps": 1e-8, "weight_decay": 0.0,
        "warmup": 0,
        "attention": True,
    }
)  # fmt: skip


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


# -- validation -----------------------------------------------------------------------
def _choice(*allowed: str) -> Callable[[Any], Any]:
    def check(v: Any) -> Any:
        if not isinstance(v, str) or v not in allowed:
            raise ValueError(f"must be one of {', '.join(allowed)}, got {v!r}")
        return v

    return check


def _int(minimum: int | None) -> Callable[[Any], Any]:
    def check(v: Any) -> Any:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"must be an integer, got {v!r}")
        if minimum is not None and v < minimum:
            raise ValueError(f"must be at least {minimum}, got {v}")
        return v

    return check


def _bool(v: Any) -> Any:
    if not isinstance(v, bool):
        raise ValueError(f"must be true or false, got {v!r}")
    return v


def _number(*, positive: bool) -> Callable[[Any], Any]:
    def check(v: Any) -> Any:
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise ValueError(f"must be a finite number, got {v!r}")
        if positive and v <= 0:
            raise ValueError(f"must be > 0, got {v!r}")
        if v < 0:
            raise ValueError(f"must be ≥ 0, got {v!r}")
        return float(v)

    return check


def _regex(v: Any) -> Any:
    if not isinstance(v, str):
        raise ValueError(f"must be a regular expression string, got {v!r}")
    try:
        re.compile(v)
    except re.error as err:
        raise ValueError(f"is not a valid regular expression ({err}): {v!r}") from None
    return v


def _thresholds(v: Any) -> Any:
    if not isinstance(v, dict):
        raise ValueError(f"must be a table of name = number, got {v!r}")
    out: dict[str, float] = {}
    for name, x in v.items():
        if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x):
            raise ValueError(f"entry {name!r} must be a finite number, got {x!r}")
        out[str(name).replace("_", "-")] = float(x)  # one spelling, so the CLI can override
    return out


_VALIDATORS: dict[str, Callable[[Any], Any]] = {
    "fail-on": _choice(*(m.value for m in FailOn)),
    "dtype": _choice(*(m.value for m in DType)),
    "amp": _choice(DType.BF16.value, DType.FP16.value),
    "batch": _int(1),
    "seq-len": _int(1),
    "batches": _int(1),
    "seed": _int(0),
    "device": _choice("cpu", "cuda", "auto"),
    "modules": _regex,
    "dropout": _bool,
    "steps": _int(0),
    "optimizer": _choice("adamw", "adam", "sgd"),
    "lr": _number(positive=True),
    "eps": _number(positive=False),
    "weight-decay": _number(positive=False),
    "warmup": _int(0),
    "attention": _bool,
    "thresholds": _thresholds,
}
KNOWN_KEYS = (*_VALIDATORS, "ignore")
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
                _regex(layers)
            except ValueError as err:
                raise error(f"{origin}: {at} layers {err}") from None
        out.append(Ignore(check=check, reason=reason.strip(), layers=layers))
    return tuple(out)


def _from_table(path: Path, where: str, table: Mapping[str, Any]) -> ProjectConfig:
    values: dict[str, Any] = {}
    ignores: tuple[Ignore, ...] = ()
    for key, raw in table.items():
        if key == "ignore":
            ignores = parse_ignores(raw, origin=path, key=f"{where} ignore", error=ConfigError)
            continue
        validate = _VALIDATORS.get(key)
        if validate is None:
            raise _unknown(path, where, key, KNOWN_KEYS)
        try:
            values[key.replace("-", "_")] = validate(raw)
        except ValueError as err:
            raise ConfigError(f"{path}: {where} {key} {err}") from None
    return ProjectConfig(path=path, values=values, ignores=ignores)


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: invalid TOML: {err}") from None
    except OSError as err:
        raise ConfigError(f"{path}: cannot read: {err.strerror or err}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text: {err}") from None


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
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        # A broken pyproject.toml that is not meant for us must not break actscan;
        # one that mentions us is reported by load_project_config.
        try:
            return "actscan" in path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return False
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


# -- the one settings object ----------------------------------------------------------
def _plain(value: Any) -> Any:
    """Enum members (the CLI's choices) as their string values."""
    return value.value if isinstance(value, Enum) else value


@dataclass(frozen=True)
class Settings:
    """Every setting of a run, resolved and validated once, with where each came from.

    Built by `Settings.resolve` (command line > project file > defaults) for the CLI, or
    directly (`Settings(fail_on="warn", batch=2)`) from Python. `thresholds` holds only
    the overrides (kebab-case name → value; `threshold_set()` gives all of them);
    `ignores` are the project's accepted findings; `project` is the file that applied.
    `sources` maps each run key, `thresholds.<name>` and `ignore` to "command line",
    the project file's path, "default" or "python".
    """

    fail_on: str = "error"
    dtype: str | Any = None  # scan() also passes a torch.dtype
    amp: str | None = None
    batch: int = 4
    seq_len: int | None = None
    batches: int = 1
    seed: int = 0
    device: str | Any = "auto"  # scan(): None is the model's own device, or a torch.device
    modules: str | None = None
    dropout: bool = False  # keep dropout on in the (train-mode) run
    # the first optimizer steps (actscan.steps.loop): 0 = the step-0 profile only
    steps: int = 0
    optimizer: str = "adamw"
    lr: float = 1e-3  # the learning rate you will train with
    eps: float = 1e-8
    weight_decay: float = 0.0
    warmup: int = 0  # linear warmup steps
    attention: bool = True  # attention probes (--no-attention: off)
    betas: tuple[float, float] = (0.9, 0.95)  # Adam's (scan(betas=...))
    backward: bool = True  # --no-backward: forward passes only
    channels: bool = True  # per-channel statistics
    init: str | None = None  # the --init scheme the model was built with (the report says it)
    at_init: bool | None = None  # the weights are an initialization; None: the resolver's say
    thresholds: Mapping[str, float] = field(default_factory=dict)
    ignores: tuple[Ignore, ...] = ()
    project: Path | None = None
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        sources = dict(self.sources)
        for key in RUN_KEYS:
            value = _plain(getattr(self, key))
            object.__setattr__(self, key, value)
            if key not in sources:
                sources[key] = SOURCE_DEFAULT if value == DEFAULTS[key] else SOURCE_API
            self._validate(key, value, sources[key])
        if sources.get("warmup") != SOURCE_SCAN and self.warmup > self.steps:
            src = sources.get("warmup", SOURCE_API)
            where = {SOURCE_CLI: "--warmup", SOURCE_API: "Settings(warmup=...)"}.get(
                src, f"{src} warmup"
            )
            raise UsageError(
                f"{where} {self.warmup} is longer than steps {self.steps}: the steps would "
                "never reach the learning rate"
            )
        object.__setattr__(self, "thresholds", self._checked_thresholds(sources))
        if self.ignores:
            ignores = parse_ignores(self.ignores, origin=sources.get("ignore", "settings"))
            object.__setattr__(self, "ignores", ignores)
        object.__setattr__(self, "sources", MappingProxyType(sources))

    def _validate(self, key: str, value: Any, source: str) -> None:
        kebab = key.replace("_", "-")
        if source == SOURCE_SCAN:
            return
        if source == SOURCE_CLI and key == "modules" and value is not None:
            try:  # the message scan() gives, before any model is built
                re.compile(value)
            except re.error as err:
                raise UsageError(f"--modules: invalid regex {value!r}: {err}") from None
        if value is None or (source == SOURCE_DEFAULT and value == DEFAULTS[key]):
            return
        try:
            _VALIDATORS[kebab](value)
        except ValueError as err:
            where = {SOURCE_CLI: f"--{kebab}", SOURCE_API: f"Settings({key}=...)"}.get(
                source, f"{source} {kebab}"
            )
            raise UsageError(f"{where} {err}") from None

    def _checked_thresholds(self, sources: dict[str, str]) -> Mapping[str, float]:
        """Fail before any model is built on a name or value scan() would refuse, naming
        where it came from; store each as a float under its kebab-case name."""
        from actscan.diagnose.thresholds import DEFAULT

        out: dict[str, float] = {}
        for name, value in self.thresholds.items():
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

        `cli` has snake- or kebab-case keys: the run keys and `thresholds` (a mapping
        name → value, as `--threshold` gives). `project` None: find the one that applies
        in the current folder.
        """
        project = find_project_config() if project is None else project
        cli = {k.replace("-", "_"): _plain(v) for k, v in (cli or {}).items()}
        if cli.get("thresholds"):  # one spelling per name: the command line overrides the file
            cli["thresholds"] = {k.replace("_", "-"): v for k, v in cli["thresholds"].items()}
        unknown = set(cli) - {*RUN_KEYS, "thresholds"}
        if unknown:
            raise TypeError(f"Settings.resolve: unknown keys {sorted(unknown)}")
        eff = effective_settings(cli, project, {**DEFAULTS, "thresholds": {}})
        sources = {k: src for k, (_, src) in eff.items()}
        if project.ignores:
            sources["ignore"] = str(project.path)
        return cls(
            **{k: eff[k][0] for k in RUN_KEYS},
            thresholds=eff["thresholds"][0],  # defaults are {}: only file and CLI names
            ignores=project.ignores,
            project=project.path,
            sources=sources,
        )

    # -- reading ---------------------------------------------------------------------
    def source(self, key: str) -> str:
        """Where `key` (a run key, `thresholds.<name>` or `ignore`) came from."""
        key = key if key.startswith("thresholds.") else key.replace("-", "_")
        return self.sources.get(key, SOURCE_DEFAULT)

    def run_values(self) -> dict[str, Any]:
        """The run settings by key, in --show-config order (thresholds and ignores apart)."""
        return {k: getattr(self, k) for k in RUN_KEYS}

    def threshold_set(self) -> Thresholds:
        """Every threshold: the defaults with this run's overrides (a `Thresholds`)."""
        from actscan.diagnose.thresholds import DEFAULT

        return DEFAULT.with_overrides(dict(self.thresholds))
