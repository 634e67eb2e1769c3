"""A setting is declared once: every use of a setting derives from the table in
actscan/settings.py (the fields of `Settings`).

Each test walks the whole table, so a setting added to it is checked here with no change
to this file: it is an option of each command it applies to (with its help, panel and
default), a project-file key, validated once with one line naming where the value came
from, shown by --show-config, and `scan()` takes it with the table's default.
"""

from __future__ import annotations

import functools
import inspect
import re
from pathlib import Path
from typing import Any

import pytest
import typer
from rich.markup import escape
from typer.testing import CliRunner

from actscan.cli import app
from actscan.cli.options import setting_options
from actscan.errors import ConfigError, UsageError
from actscan.settings import (
    COMMANDS,
    CONFIG,
    IGNORES,
    PANELS,
    RUN_KEYS,
    SCAN,
    SETTINGS,
    THRESHOLDS,
    Integer,
    Number,
    OneOf,
    ProjectConfig,
    Setting,
    Settings,
    betas_pair,
    boolean,
    load_project_config,
    regex,
    text,
)

TABLES = (THRESHOLDS, IGNORES)  # tables of their own, tested by name below
# scan()'s keywords that are not settings: what to scan and how to describe it.
SCAN_NOT_SETTINGS = {
    *("model", "inputs", "loss_fn", "info", "layout", "progress"),
    "decode_token",
}


def sample(s: Setting) -> tuple[str, Any]:
    """A valid value other than the default: (as typed on the command line, as stored)."""
    check = s.check
    if isinstance(check, OneOf):
        choice = next(c for c in reversed(check.choices) if c != s.default)
        return choice, choice
    if isinstance(check, Integer):
        n = max(check.minimum, s.default or 0) + 2
        return str(n), n
    if isinstance(check, Number):
        x = (s.default or 0.0) * 2 + 0.25
        return repr(x), x
    if check is regex:
        return r"blocks\.1", r"blocks\.1"
    if check is boolean:
        return "", not s.default
    raise AssertionError(f"no sample for {s.name}: teach sample() its check {check!r}")


def bad(s: Setting) -> Any:
    """A value the setting's check refuses (as a project file or Python would give it)."""
    check = s.check
    if isinstance(check, OneOf):
        return "no-such-choice"
    if isinstance(check, Integer):
        return check.minimum - 1
    if isinstance(check, Number):
        return -1.0
    if check is regex:
        return "("
    if check is boolean:
        return "yes"
    if check is betas_pair:
        return (0.9, 1.0)
    if check is text:
        return ""
    raise AssertionError(f"no bad value for {s.name}: teach bad() its check {check!r}")


def toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, int | float) else f"'{value}'"


PLAIN = [s for s in SETTINGS if s.name not in TABLES]
ON_COMMANDS = [(cmd, s) for cmd in sorted(COMMANDS) for s in SETTINGS if cmd in s.applies]
IN_CONFIG = [s for s in PLAIN if CONFIG in s.applies]


def cli(*args: str) -> Any:
    return CliRunner().invoke(app, list(args), env={"NO_COLOR": "1", "COLUMNS": "400"})


@functools.cache
def help_of(cmd: str) -> str:
    """`actscan CMD --help` with the table's borders and wrapping taken out."""
    return re.sub(r"\s*│\s*", " ", cli(cmd, "--help").stdout)


def command(name: str) -> Any:
    """The click command typer builds for `name` (typer carries its own click)."""
    return typer.main.get_command(app).commands[name]  # type: ignore[attr-defined]


def test_the_table_is_complete() -> None:
    """Every row says where it applies; a command option has a flag and a panel."""
    assert [s.name for s in SETTINGS][:3] == ["fail_on", "dtype", "amp"]
    for s in SETTINGS:
        assert s.help.endswith(".") and s.applies, s.name
        assert s.applies <= COMMANDS | {CONFIG, SCAN}, s.name
        if s.applies & COMMANDS:
            assert s.flag is not None and s.flag.startswith("--") and s.panel in PANELS, s.name


@pytest.mark.parametrize(("cmd", "s"), ON_COMMANDS, ids=lambda x: getattr(x, "name", x))
def test_each_setting_is_an_option_of_each_command_it_applies_to(cmd: str, s: Setting) -> None:
    options = {o: p for p in command(cmd).params for o in p.opts}
    param = options[s.flag]
    assert param.name == s.name
    assert param.help == escape(s.help_text())  # typed once, escaped once
    assert getattr(param, "rich_help_panel", None) == s.panel
    assert param.default in (None, False)  # not given: the project file and the default apply
    assert s.help_text() in help_of(cmd), s.flag


def test_no_option_for_a_setting_that_does_not_apply() -> None:
    for cmd in COMMANDS:
        flags = {o for p in command(cmd).params for o in p.opts}
        for s in SETTINGS:
            if cmd not in s.applies and s.flag is not None:
                assert s.flag not in flags, (cmd, s.flag)


def test_each_option_reaches_the_settings_from_the_command_line() -> None:
    """The decorator every command uses: a flag's value lands in `settings`, marked as
    the command line's; an option not given leaves the default."""
    seen: dict[str, Settings] = {}
    probe = typer.Typer()

    @probe.command()
    @setting_options("profile")
    def run(settings: Settings) -> None:
        seen["s"] = settings

    @probe.command()
    def other() -> None: ...

    def invoke(*args: str) -> Settings:
        result = CliRunner().invoke(probe, ["run", *args], catch_exceptions=False)
        assert result.exit_code == 0, (args, result.output)
        return seen["s"]

    given = [s for s in PLAIN if "profile" in s.applies]
    plain = invoke()
    for s in given:
        assert (getattr(plain, s.name), plain.source(s.name)) == (s.default, "default")
    # --no-backward cannot go with --steps: alone, then every other one at once
    backward = [s for s in given if s.name == "backward"]
    for batch in (backward, [s for s in given if s not in backward]):
        args: list[str] = []
        for s in batch:
            assert s.flag is not None
            args += [s.flag] if s.check is boolean else [s.flag, sample(s)[0]]
        got = invoke(*args)
        for s in batch:
            assert (getattr(got, s.name), got.source(s.name)) == (sample(s)[1], "command line")
    got = invoke("--threshold", "outlier-ratio=3", "--threshold", "growth_warn=5")
    assert dict(got.thresholds) == {"outlier-ratio": 3.0, "growth-warn": 5.0}
    assert got.source("thresholds.outlier-ratio") == "command line"


@pytest.mark.parametrize("s", IN_CONFIG, ids=lambda s: s.name)
def test_each_setting_is_a_project_key_validated_with_one_line(tmp_path: Path, s: Setting) -> None:
    _, stored = sample(s)
    path = tmp_path / "pyproject.toml"
    steps = "" if s.name == "steps" else "steps = 10\n"  # room for any warmup
    path.write_text(f"[tool.actscan]\n{steps}{s.key} = {toml(stored)}\n")
    project = load_project_config(path)
    assert project.values[s.name] == stored
    settings = Settings.resolve({}, project)
    assert (getattr(settings, s.name), settings.source(s.name)) == (stored, str(path))

    path.write_text(f"[tool.actscan]\n{s.key} = {toml(bad(s))}\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: \[tool.actscan\] {s.key} "):
        load_project_config(path)
    if "_" in s.name:  # the snake spelling is refused, pointing at the kebab one
        path.write_text(f"[tool.actscan]\n{s.name} = {toml(stored)}\n")
        with pytest.raises(ConfigError, match=f"did you mean '{s.key}'"):
            load_project_config(path)


@pytest.mark.parametrize("s", [s for s in PLAIN if s.check is not None], ids=lambda s: s.name)
def test_one_validation_names_the_source(s: Setting) -> None:
    """Python, scan() and the command line are refused by the same check, each message
    naming the setting the way its source spells it."""
    with pytest.raises(UsageError, match=rf"^Settings\({s.name}=\.\.\.\) "):
        Settings(**{s.name: bad(s)})
    with pytest.raises(UsageError, match=rf"^{re.escape(s.flag or s.scan_name)} "):
        Settings.given("scan()", **{s.scan_name: bad(s)})
    if s.applies & COMMANDS and s.check is not boolean:
        with pytest.raises(UsageError, match=rf"^{re.escape(s.flag or '')} "):
            Settings.resolve({s.name: bad(s)}, ProjectConfig(path=None))


def test_show_config_lists_every_project_setting_with_its_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lines = [f"{s.key} = {toml(sample(s)[1])}" for s in IN_CONFIG[::2]]
    lines.append("thresholds = { outlier-ratio = 7 }")
    (tmp_path / "actscan.toml").write_text("\n".join(lines) + "\n")
    monkeypatch.chdir(tmp_path)
    result = cli("profile", "anything", "--show-config")
    assert result.exit_code == 0, result.output
    rows = {}
    for line in result.stdout.splitlines():
        cells = [c.strip() for c in re.split(r"[│┃|]", line) if c.strip()]
        if len(cells) == 3:
            rows[cells[0]] = (cells[1], cells[2])
    assert [k for k in rows if not k.startswith(("threshold ", "setting"))] == [
        k.replace("_", "-") for k in RUN_KEYS
    ]
    assert tuple(s.name for s in IN_CONFIG) == RUN_KEYS
    for i, s in enumerate(IN_CONFIG):
        value = sample(s)[1] if i % 2 == 0 else s.default
        source = "actscan.toml" if i % 2 == 0 else "default"
        assert rows[s.key] == ("—" if value is None else str(value), source), s.name
    assert rows["threshold outlier-ratio"] == ("7", "actscan.toml")


def test_scan_takes_every_scan_setting_with_the_tables_default() -> None:
    from actscan.run import scan

    params = inspect.signature(scan).parameters
    for s in SETTINGS:
        if SCAN in s.applies:
            assert s.scan_name in params, f"scan() lacks the setting {s.scan_name}"
            assert params[s.scan_name].default == s.scan_default, s.name
        else:
            assert s.scan_name not in params, f"{s.name} is a scan() keyword: add SCAN"
    settings = {s.scan_name for s in SETTINGS if SCAN in s.applies}
    assert set(params) - settings == SCAN_NOT_SETTINGS  # a new keyword is a setting or listed


def test_settings_given_by_scan_keywords() -> None:
    s = Settings.given("scan()", ignore=[{"check": "collapse", "reason": "r"}], thresholds=None)
    assert s.ignores[0].check == "collapse" and dict(s.thresholds) == {}
    assert s.source("ignore") == "scan()" and s.source("batch") == "default"
    with pytest.raises(UsageError, match=r"^--steps needs the backward pass: drop --no-backward$"):
        Settings.given("scan()", steps=1, backward=False)


def test_help_keeps_bracketed_text_and_groups_options_in_panels() -> None:
    """Rich markup used to eat "[auto]", "[adamw]", "[error]" and "actscan[plot]"."""
    text = cli("profile", "--help").stdout
    for needle in ("[auto]", "[adamw]", "[error]", "actscan[plot]", "[1e-3]", "[4]"):
        assert needle in text, needle
    for panel in PANELS:
        assert re.search(rf"╭─ {panel} ─", text), panel
    for cmd in ("compare", "sweep"):
        assert "[adamw]" in cli(cmd, "--help").stdout
