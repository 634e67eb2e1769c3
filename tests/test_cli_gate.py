"""The CI gate end to end through `actscan profile`: exit codes, --quiet, plain output,
machine-readable reports (JSON schema, JUnit, Markdown), atomic writes, and project
configuration ([tool.actscan] / actscan.toml) reaching the scan and the checks.

Most tests plant findings by handing the CLI another check runner (typer's context object,
`Wiring(checks=...)`), so the gate logic is tested independently of which real checks
fire; `test_naive_model_*` uses the real checks on the built-in broken-on-purpose config.
"""

from __future__ import annotations

import io
import json
import os
import re
import sys
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import typer
from helpers import planted_checks
from typer.testing import CliRunner

from actscan.api import Wiring
from actscan.cli import app
from actscan.records import Finding, Severity
from actscan.report.schema import validate_report

pytest.importorskip("jsonschema")

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted(p for p in (REPO / "configs").iterdir() if p.suffix in {".yaml", ".toml"})
SAMPLES = sorted(
    [*(REPO / "sample_models").glob("*.safetensors")]
    + [p.parent for p in (REPO / "sample_models").glob("*/config.json")]
)
# A 2-block built-in model: builds and runs in well under a second.
TINY = ["gpt-12-preln", "--set", "n_layers=2", "--set", "d_model=32", "--set", "n_heads=2"]
SMALL_RUN = ["--seq-len", "8", "--batch", "2"]
ANSI = re.compile(r"\x1b\[")
# The running test's planted check runner (set by the `plant` fixture, cleared after it).
WIRING: list[Wiring] = []


def cli(*args: str, env: dict[str, str] | None = None) -> Any:
    """Run `actscan ARGS` in-process (wired to the planted checks, if any); result.stdout
    and result.stderr are separate."""
    obj = WIRING[-1] if WIRING else None
    return CliRunner().invoke(app, list(args), env=env, obj=obj)


def profile(*extra: str, target: list[str] = TINY) -> Any:
    return cli("profile", *target, *SMALL_RUN, *extra)


def finding(
    check: str = "dead-branch", severity: str = "warn", layers: tuple[str, ...] = ("blocks.1.mlp",)
) -> Finding:
    return Finding(
        check=check,
        severity=Severity(severity),
        layers=layers,
        value=0.0,
        threshold=1e-3,
        message=f"planted {check} {severity}",
        hint="planted by the test",
    )


Planted = Callable[..., dict[str, Any]]


@pytest.fixture
def plant() -> Iterator[Planted]:
    """plant(*findings_or_fns) → the findings the scans of `cli()` report (a fn gets the
    CheckContext).

    Returns a dict that records the CheckContext of the last scan ("ctx").
    """
    seen: dict[str, Any] = {}

    def install(*items: Finding | Callable[[Any], Finding]) -> dict[str, Any]:
        def run_checks(ctx: Any) -> tuple[Finding, ...]:
            seen["ctx"] = ctx
            return tuple(item(ctx) if callable(item) else item for item in items)

        WIRING[:] = [Wiring(checks=planted_checks(run_checks))]
        return seen

    yield install
    WIRING.clear()


@pytest.fixture(autouse=True)
def isolated_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run in an empty folder so no project config on the way up interferes."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.delenv("ACTSCAN_DEBUG", raising=False)
    return work


# -- exit codes ---------------------------------------------------------------------------
GATE = {  # planted severity → the --fail-on values that make the run exit 1
    None: set(),
    "info": {"info"},
    "warn": {"info", "warn"},
    "error": {"info", "warn", "error", "default"},
}


@pytest.mark.parametrize("severity", list(GATE))
@pytest.mark.parametrize("fail_on", ["info", "warn", "error", "never", "default"])
def test_exit_code_matrix(plant: Planted, severity: str | None, fail_on: str) -> None:
    seen = plant(*([finding(severity=severity)] if severity else []))
    args = [] if fail_on == "default" else ["--fail-on", fail_on]
    result = profile("--quiet", *args)
    assert "ctx" in seen, "scan() no longer calls the planted check runner"
    want = 1 if fail_on in GATE[severity] else 0
    assert result.exit_code == want, result.output
    if severity:
        assert f"planted dead-branch {severity}" in result.stdout


def test_worst_finding_decides(plant: Planted) -> None:
    plant(finding("sqrt-growth", "info"), finding("dead-branch", "error"))
    assert profile("-q", "--fail-on", "error").exit_code == 1
    plant(finding("sqrt-growth", "info"), finding("dead-branch", "warn"))
    assert profile("-q", "--fail-on", "error").exit_code == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["profile", "no/such/model.safetensors"], "no/such/model.safetensors"),
        (["profile", *TINY, "--threshold", "no-such=1"], "no-such"),
        (["profile", *TINY, "--threshold", "outlier-ratio"], "NAME=VALUE"),
        (["profile", *TINY, "--json", "-", "--format", "junit"], "stdout"),
        (["profile", *TINY, "--format", "markdown", "-o", "missing/dir/out.md"], "missing/dir"),
        (["profile", *TINY, "--modules", "("], "regex"),
    ],
)
def test_usage_errors_exit_2_with_one_line(args: list[str], message: str) -> None:
    result = cli(*args, *SMALL_RUN)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("actscan: error: "), result.stderr
    assert message in lines[0]
    assert "Traceback" not in result.output
    assert result.stdout == ""


@pytest.mark.parametrize("args", [["--fail-on", "sometimes"], ["--no-such-option"]])
def test_bad_options_exit_2(args: list[str]) -> None:
    result = profile(*args)
    assert result.exit_code == 2
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    "command",
    [
        ["compare", *TINY, "--vs-init", "fan-in"],
        ["sweep", "gpt-12-preln", "--depth", "2,3", "--set", "d_model=32", "--set", "n_heads=2"],
    ],
    ids=["compare", "sweep"],
)
@pytest.mark.parametrize(("fail_on", "code"), [("warn", 1), ("error", 0), ("never", 0)])
def test_compare_and_sweep_share_the_gate(
    plant: Planted, command: list[str], fail_on: str, code: int
) -> None:
    plant(finding("dead-branch", "warn"))
    result = cli(*command, *SMALL_RUN, "-q", "--fail-on", fail_on, "--format", "junit")
    assert result.exit_code == code, result.output
    root = ET.fromstring(result.stdout.encode())
    suites = root.findall("testsuite")
    assert len(suites) == 2 and len({s.get("name") for s in suites}) == 2  # told apart
    assert int(root.get("failures")) == 2 * code  # the planted finding, once per model


# -- human output -------------------------------------------------------------------------
def test_quiet_prints_only_findings(plant: Planted) -> None:
    plant(finding("dead-branch", "warn"))
    loud, quiet = profile(), profile("--quiet")
    assert loud.exit_code == quiet.exit_code == 0
    assert "Residual stream" in loud.stdout and "planted dead-branch warn" in loud.stdout
    assert "planted dead-branch warn" in quiet.stdout
    for noise in ("Residual stream", "Branches", "Stream:", "actscan gpt-12-preln"):
        assert noise not in quiet.stdout
    assert quiet.stderr == ""


def test_non_tty_output_is_plain() -> None:
    result = profile()
    assert result.exit_code == 0
    assert not ANSI.search(result.output)
    assert "\r" not in result.output  # no progress bar redraws


class _FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def _run_on_tty(monkeypatch: pytest.MonkeyPatch, *args: str) -> tuple[int, str]:
    """Run the CLI with stdout/stderr that claim to be terminals (as in a shell)."""
    out = _FakeTTY()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", out)
    monkeypatch.setenv("TERM", "xterm-256color")
    for var in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):
        monkeypatch.delenv(var, raising=False)
    code = typer.main.get_command(app).main(list(args), standalone_mode=False)
    return int(code or 0), out.getvalue()


def test_no_color_on_a_terminal_is_plain(monkeypatch: pytest.MonkeyPatch) -> None:
    code, colored = _run_on_tty(monkeypatch, "profile", *TINY, *SMALL_RUN)
    assert code == 0
    assert ANSI.search(colored), "control: a terminal without NO_COLOR gets styles"
    monkeypatch.setenv("NO_COLOR", "1")
    code, plain = _run_on_tty(monkeypatch, "profile", *TINY, *SMALL_RUN)
    assert code == 0
    assert "Residual stream" in plain
    assert not ANSI.search(plain) and "\r" not in plain


# -- reports ------------------------------------------------------------------------------
def test_json_to_stdout_is_parseable_and_table_goes_to_stderr(plant: Planted) -> None:
    plant(finding("dead-branch", "warn"))
    result = profile("--json", "-")
    assert result.exit_code == 0
    data = json.loads(result.stdout)
    validate_report(data)
    assert [f["check"] for f in data["findings"]] == ["dead-branch"]
    assert "Residual stream" in result.stderr and "planted dead-branch" in result.stderr


@pytest.mark.parametrize("fmt", ["json", "markdown", "junit"])
def test_format_to_stdout_keeps_stdout_clean(plant: Planted, fmt: str) -> None:
    plant(finding("dead-branch", "error"))
    result = profile("--format", fmt)
    assert result.exit_code == 1
    if fmt == "json":
        validate_report(json.loads(result.stdout))
    elif fmt == "junit":
        assert ET.fromstring(result.stdout.encode()).get("failures") == "1"
    else:
        assert result.stdout.startswith("### actscan:") and "#### Residual stream" in result.stdout
    assert "RMS vs depth" not in result.stdout
    assert "RMS vs depth" in result.stderr  # the human table, on stderr
    quiet = profile("--format", fmt, "--quiet")
    assert quiet.stdout == result.stdout and quiet.stderr == ""


@pytest.mark.parametrize(
    ("fail_on", "failures", "code"),
    [("info", 3, 1), ("warn", 2, 1), ("error", 0, 0), ("never", 0, 0)],
)
def test_junit_file_failure_count(
    plant: Planted, isolated_cwd: Path, fail_on: str, failures: int, code: int
) -> None:
    plant(
        finding("dead-branch", "warn"),
        finding("dead-branch", "info", layers=("blocks.0.mlp",)),
        finding("outlier-channels", "warn"),
        finding("sqrt-growth", "info", layers=()),
    )
    result = profile("--fail-on", fail_on, "--format", "junit", "-o", "actscan.xml")
    assert result.exit_code == code
    root = ET.parse(isolated_cwd / "actscan.xml").getroot()
    suites = root.findall("testsuite")
    assert len(suites) == 1
    cases = suites[0].findall("testcase")
    failed = sorted(c.get("name") for c in cases if c.find("failure") is not None)
    assert len(failed) == failures == int(root.get("failures"))
    assert len(cases) == len({c.get("name") for c in cases}) >= 11  # one case per check
    assert failures == 0 or "dead-branch" in failed
    assert "Residual stream" in result.stdout  # -o PATH: the table still goes to stdout


def test_markdown_file(plant: Planted, isolated_cwd: Path) -> None:
    plant(finding("dead-branch", "warn"))
    result = profile("--fail-on", "warn", "--format", "markdown", "-o", "report.md", "-q")
    assert result.exit_code == 1
    text = (isolated_cwd / "report.md").read_text()
    assert text.startswith("### actscan: `gpt-12-preln`") or text.startswith("### actscan: `")
    assert "| warn | dead-branch | `blocks.1.mlp` | planted dead-branch warn |" in text
    assert "#### Residual stream" in text and "| 0 | — | `blocks.0:input` |" in text
    assert "**FAIL** at `--fail-on warn`: 1 finding(s)" in text


def test_json_file_and_format_file_together(plant: Planted, isolated_cwd: Path) -> None:
    plant(finding("outlier-channels", "info"))
    result = profile("--json", "r.json", "--format", "junit", "-o", "r.xml", "-q")
    assert result.exit_code == 0
    validate_report(json.loads((isolated_cwd / "r.json").read_text()))
    ET.parse(isolated_cwd / "r.xml")
    assert sorted(p.name for p in isolated_cwd.iterdir()) == ["r.json", "r.xml"]  # no temp files


def test_output_write_is_atomic(isolated_cwd: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    old = isolated_cwd / "actscan.xml"
    old.write_text("previous report\n")

    def refuse(src: Any, dst: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", refuse)
    result = profile("--format", "junit", "-o", "actscan.xml")
    assert result.exit_code == 2
    assert "cannot write actscan.xml" in result.stderr
    assert old.read_text() == "previous report\n"
    assert [p.name for p in isolated_cwd.iterdir()] == ["actscan.xml"]


@pytest.mark.parametrize(
    "opt", [["--json", "no/dir/r.json"], ["--format", "junit", "-o", "no/dir/r.xml"]]
)
def test_missing_output_folder_fails_before_the_scan(plant: Planted, opt: list[str]) -> None:
    seen = plant()
    result = profile(*opt)
    assert result.exit_code == 2
    assert "folder no/dir does not exist" in result.stderr
    assert "ctx" not in seen  # refused up front, not after a long scan


def test_failed_scan_leaves_existing_report(isolated_cwd: Path) -> None:
    old = isolated_cwd / "report.json"
    old.write_text("{}")
    result = cli("profile", "missing.safetensors", "--json", "report.json")
    assert result.exit_code == 2
    assert old.read_text() == "{}"


def _validate_cli_json(target: list[str], out: Path, *extra: str) -> dict[str, Any]:
    result = cli("profile", *target, "--json", str(out), "--fail-on", "never", "-q", *extra)
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    validate_report(data)
    assert data["layers"] and data["stream"]
    return data


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_report_validates(config: Path, isolated_cwd: Path) -> None:
    # Narrow and at most 12 blocks: fast, and still the config's layout and init.
    shrink = ["--set", "d_model=32", "--set", "n_heads=2", "--set", "vocab_size=128"]
    shrink += ["--set", "n_layers=12"]
    data = _validate_cli_json([str(config), *shrink], isolated_cwd / "r.json", *SMALL_RUN)
    assert data["model"]["family"] == "actscan-gpt"


@pytest.mark.slow
@pytest.mark.skipif(not SAMPLES, reason="no sample models generated yet (sample_models/)")
@pytest.mark.parametrize("sample", SAMPLES, ids=[p.name for p in SAMPLES])
def test_every_sample_report_validates(sample: Path, isolated_cwd: Path) -> None:
    _validate_cli_json([str(sample)], isolated_cwd / "r.json", *SMALL_RUN)


@pytest.mark.slow
@pytest.mark.parametrize("fail_on", ["info", "error"])
def test_naive_model_real_checks_gate(fail_on: str, isolated_cwd: Path) -> None:
    """No planting: the real checks on a 48-block unscaled model. The exit code must
    agree with the findings in the JSON, for every gate."""
    target = ["gpt-48-naive", "--set", "d_model=64", "--set", "vocab_size=128"]
    result = cli("profile", *target, *SMALL_RUN, "--fail-on", fail_on, "--json", "r.json", "-q")
    data = json.loads((isolated_cwd / "r.json").read_text())
    assert data["findings"], "the broken-on-purpose config must produce findings"
    rank = {"info": 0, "warn": 1, "error": 2}
    tripped = any(rank[f["severity"]] >= rank[fail_on] for f in data["findings"])
    assert result.exit_code == int(tripped), result.output
    if fail_on == "info":
        assert result.exit_code == 1


# -- project configuration ----------------------------------------------------------------
def _project(tmp_path: Path, body: str, name: str = "pyproject.toml") -> Path:
    """tmp_path/proj/<name> holding `body`; returns proj/src/deep (created) to chdir into."""
    proj = tmp_path / "proj"
    deep = proj / "src" / "deep"
    deep.mkdir(parents=True)
    (proj / name).write_text(body, encoding="utf-8")
    return deep


@pytest.mark.parametrize("name", ["pyproject.toml", "actscan.toml"])
def test_project_fail_on_found_from_nested_folder_and_cli_wins(
    plant: Planted, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    body = 'fail-on = "warn"\n'
    if name == "pyproject.toml":
        body = f'[project]\nname = "m"\n\n[tool.actscan]\n{body}'
    deep = _project(tmp_path, body, name)
    plant(finding("dead-branch", "warn"))
    assert profile("-q").exit_code == 0  # outside the project: default gate is error
    monkeypatch.chdir(deep)
    assert profile("-q").exit_code == 1  # the file's fail-on = warn applies
    assert profile("-q", "--fail-on", "error").exit_code == 0  # the command line wins


def test_project_run_settings_reach_the_scan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(
        _project(
            tmp_path,
            '[tool.actscan]\nbatch = 3\nseq-len = 12\ndtype = "bf16"\nmodules = "blocks\\\\.1"\n',
        )
    )
    result = cli("profile", *TINY, "--json", "-", "-q")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert (data["run"]["batch"], data["run"]["seq_len"], data["run"]["dtype"]) == (3, 12, "bf16")
    assert data["layers"] and all(x["name"].startswith("blocks.1") for x in data["layers"])
    result = cli("profile", *TINY, "--json", "-", "-q", "--batch", "2", "--dtype", "fp32")
    data = json.loads(result.stdout)
    assert (data["run"]["batch"], data["run"]["seq_len"], data["run"]["dtype"]) == (2, 12, "fp32")


def test_project_thresholds_reach_the_checks(
    plant: Planted, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(_project(tmp_path, "[tool.actscan]\nthresholds = { outlier-ratio = 7.5 }\n"))
    seen = plant()
    assert profile("-q").exit_code == 0
    assert seen["ctx"].thresholds.outlier_ratio == 7.5
    assert seen["ctx"].thresholds.outlier_abs == 0.0  # untouched: the default (off)
    result = profile("-q", "--threshold", "outlier-ratio=3", "--threshold", "outlier_abs=2")
    assert result.exit_code == 0, result.output
    assert (seen["ctx"].thresholds.outlier_ratio, seen["ctx"].thresholds.outlier_abs) == (3, 2)


def test_show_config_prints_values_and_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    deep = _project(
        tmp_path,
        '[tool.actscan]\nfail-on = "warn"\nseq-len = 16\nthresholds = { outlier-ratio = 9 }\n'
        'ignore = [{ check = "dead-branch", layers = "rezero", reason = "zero at init" }]\n',
    )
    monkeypatch.chdir(deep)
    pyproject = str((tmp_path / "proj" / "pyproject.toml").resolve())
    result = cli("profile", "anything", "--show-config", "--seq-len", "8")
    assert result.exit_code == 0, result.output
    rows = {}
    for line in result.stdout.splitlines():
        cells = [c.strip() for c in re.split(r"[│┃|]", line) if c.strip()]
        if len(cells) == 3:
            rows[cells[0]] = (cells[1], cells[2])
    assert f"project config: {pyproject}" in result.stdout
    assert rows["fail-on"] == ("warn", "pyproject.toml")
    assert rows["seq-len"] == ("8", "command line")
    assert rows["seed"] == ("0", "default")
    assert rows["threshold outlier-ratio"] == ("9", "pyproject.toml")
    assert rows["threshold outlier-abs"] == ("0", "default")
    assert "ignore dead-branch at /rezero/: zero at init" in result.stdout


@pytest.mark.parametrize(
    ("body", "names"),
    [
        ('[tool.actscan]\nfail_on = "warn"\n', ["fail_on", "fail-on"]),
        ("[tool.actscan]\nbatchsize = 2\n", ["batchsize"]),
        ("[tool.actscan]\nthresholds = { no-such = 1.0 }\n", ["no-such"]),
        ('[tool.actscan]\nfail-on = "sometimes"\n', ["fail-on", "sometimes"]),
        ('[tool.actscan]\nignore = [{ check = "dead-branch" }]\n', ["reason"]),
    ],
)
def test_bad_project_config_exits_2_naming_file_and_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str, names: list[str]
) -> None:
    monkeypatch.chdir(_project(tmp_path, body))
    for args in (["profile", *TINY, *SMALL_RUN], ["profile", "x", "--show-config"]):
        result = cli(*args)
        assert result.exit_code == 2, result.output
        line = result.stderr.strip()
        assert line.startswith("actscan: error: ") and "\n" not in line
        assert "pyproject.toml" in line
        for name in names:
            assert name in line


@pytest.mark.slow
def test_ignores_remove_findings_from_the_gate(
    plant: Planted, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ignore = (
        '{ check = "dead-branch", layers = "blocks\\\\.1\\\\.", reason = "ReZero: zero at init" }'
    )
    monkeypatch.chdir(
        _project(tmp_path, f'[tool.actscan]\nfail-on = "warn"\nignore = [{ignore}]\n')
    )
    plant(finding("dead-branch", "error", layers=("blocks.1.mlp",)), finding("sqrt-growth", "info"))
    result = profile()
    assert result.exit_code == 0, result.output
    assert "ignored dead-branch" in result.stdout and ": ReZero: zero at init" in result.stdout
    data = json.loads(profile("--json", "-", "-q").stdout)
    assert [f["check"] for f in data["findings"]] == ["sqrt-growth"]
    junit = ET.fromstring(profile("--format", "junit", "-q").stdout.encode())
    assert junit.get("failures") == "0"
    # The same check on a layer the ignore does not name still trips the gate.
    plant(finding("dead-branch", "warn", layers=("blocks.0.mlp",)))
    result = profile("-q")
    assert result.exit_code == 1 and "ignored" not in result.stdout


# -- one entry point: profile, compare and sweep all gate on the same findings -----------
@pytest.mark.slow
def test_every_command_goes_through_scan_target(
    plant: Planted, monkeypatch: pytest.MonkeyPatch
) -> None:
    import actscan.api as pipeline

    real = pipeline.scan_target
    calls: list[tuple[str, str | None]] = []

    def spy(spec: Any, settings: Any, **kwargs: Any) -> Any:
        calls.append((spec.target, settings.dtype))
        return real(spec, settings, **kwargs)

    monkeypatch.setattr(pipeline, "scan_target", spy)
    plant()
    assert profile("-q").exit_code == 0
    assert calls == [("gpt-12-preln", None)]
    calls.clear()
    assert cli("compare", *TINY, "--vs-dtype", "bf16", *SMALL_RUN, "-q").exit_code == 0
    assert calls == [("gpt-12-preln", None), ("gpt-12-preln", "bf16")]
    calls.clear()
    sweep = cli("sweep", *TINY, "--depth", "2,3", *SMALL_RUN, "-q")
    assert sweep.exit_code == 0, sweep.output
    assert calls == [("gpt-12-preln", None)] * 2


@pytest.mark.slow
@pytest.mark.parametrize(
    "command",
    [
        ["compare", *TINY, "--vs-init", "fan-in", *SMALL_RUN],
        ["sweep", *TINY, "--depth", "2,3", *SMALL_RUN],
    ],
    ids=["compare", "sweep"],
)
def test_project_ignores_leave_the_compare_and_sweep_gate(
    plant: Planted, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: list[str]
) -> None:
    plant(finding("dead-branch", "error", layers=("blocks.1.mlp",)), finding("collapse", "info"))
    assert cli(*command, "-q").exit_code == 1  # no project config: the error trips the gate
    ignore = '{ check = "dead-branch", layers = "blocks\\\\.1\\\\.", reason = "ReZero" }'
    monkeypatch.chdir(_project(tmp_path, f"[tool.actscan]\nignore = [{ignore}]\n"))
    result = cli(*command, "-q", "--json", "-")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    reports = [data["a"], data["b"]] if "a" in data else [r["report"] for r in data["rows"]]
    assert len(reports) == 2
    assert all([f["check"] for f in r["findings"]] == ["collapse"] for r in reports)
    assert cli(*command, "-q", "--fail-on", "info").exit_code == 1  # the rest still gates


def _private_reaches(path: Path) -> list[str]:
    """`from actscan.x import _y` and `module._y` where `module` is an actscan import."""
    import ast

    tree = ast.parse(path.read_text(encoding="utf-8"))
    modules: set[str] = set()  # local names bound to actscan modules
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("actscan"):
            for alias in node.names:
                if alias.name.startswith("_") and alias.name != "__version__":
                    out.append(f"from {node.module} import {alias.name}")
                modules.add(alias.asname or alias.name)  # may be a submodule
        elif isinstance(node, ast.Import):
            modules |= {a.asname or a.name for a in node.names if a.name.startswith("actscan")}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
        ):
            out.append(f"{node.value.id}.{node.attr}")
    return out


def test_cli_modules_stay_apart(tmp_path: Path) -> None:
    """Command modules never import each other; no module of the package reaches into
    another module's private names."""
    pkg = REPO / "actscan"
    commands = {"profile", "compare", "sweep", "configs"}
    for path in sorted((pkg / "cli").glob("*.py")):
        text = path.read_text(encoding="utf-8")
        for other in commands - {path.stem} if path.stem in commands else ():
            assert f"actscan.cli.{other}" not in text, f"{path.name} imports cli/{other}.py"
            assert f"from actscan.cli import {other}" not in text, path.name
    reaches = {str(p.relative_to(REPO)): _private_reaches(p) for p in pkg.rglob("*.py")}
    assert not {k: v for k, v in reaches.items() if v}
    probe = tmp_path / "probe.py"  # the detector itself sees a reach when there is one
    probe.write_text(
        "from actscan.models.gpt import _linear_std, build_model\n"
        "import actscan.run as sc\nsc._hidden()\nsc.scan()\n"
    )
    assert _private_reaches(probe) == ["from actscan.models.gpt import _linear_std", "sc._hidden"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("target", "flag", "judged"),
    [
        (str(REPO / "sample_models" / "gpt-48-naive.safetensors"), None, False),
        (str(REPO / "sample_models" / "gpt-48-naive.safetensors"), "--at-init", True),
        ("gpt-48-naive", None, True),
        ("gpt-48-naive", "--trained", False),
    ],
)
def test_at_init_and_trained_override_the_resolver(
    target: str, flag: str | None, judged: bool
) -> None:
    """A checkpoint is taken as trained and a config as an init; the flag overrides both,
    and init-scale runs exactly when the weights are judged an initialization."""
    # 10 layers: 20 unscaled branches, clear of the residual budget's 16 (at 8 layers the
    # budget is 16·s² with s ≈ 1 drawn: on the threshold, a coin flip of the init's draws)
    args = [target, "--set", "n_layers=10"] if target == "gpt-48-naive" else [target]
    result = cli("profile", *args, *([flag] if flag else []), "-q", "--json", "-")
    assert result.exit_code in (0, 1), result.output
    data = json.loads(result.stdout)
    assert ("init-scale" in {f["check"] for f in data["findings"]}) is judged
