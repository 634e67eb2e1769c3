"""README "Use it in CI" and examples/ cannot rot: the README shows the example files
verbatim, and every command they contain runs here against a small stand-in model
(`configs/model.yaml` in a temporary project folder)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from typer.testing import CliRunner

from actscan.cli import app
from actscan.report.schema import validate_report
from actscan.settings import load_project_config

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
BIN = Path(sys.executable).parent
# The user's model in the examples: a small, properly scaled pre-norm transformer
# (fan-in init, 1/sqrt(2L) residual projections, untied head)…
MODEL_YAML = """\
family: actscan-gpt
n_layers: 4
d_model: 64
n_heads: 4
vocab_size: 256
seq_len: 32
branch_scale: depth
init: fan-in
tie_embeddings: false
"""
# …and the same model after a bad change: a flat init of std 1 (a typo for 0.02). (48
# unscaled blocks at 0.02 are no break: √k growth is what Llama's own init ships, info.)
BROKEN_YAML = """\
family: actscan-gpt
n_layers: 4
d_model: 64
n_heads: 4
vocab_size: 256
seq_len: 32
branch_scale: depth
init: gpt2
init_std: 1.0
tie_embeddings: false
"""
SHELL_OPS = {"|", ">", ">>", "||", "&&", ";", "2>", "2>&1"}


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A user's repository: configs/model.yaml, nothing else."""
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "model.yaml").write_text(MODEL_YAML)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("NO_COLOR", raising=False)
    return tmp_path


def ci_section() -> str:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    start = text.index("## Use it in CI")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", ci_section(), flags=re.S | re.M)


def run_actscan_line(line: str, cwd: Path) -> tuple[Any, list[str]]:
    """Run the actscan part of a shell line in-process (up to the first pipe/redirect)."""
    argv = shlex.split(line)
    cut = next((i for i, tok in enumerate(argv) if tok in SHELL_OPS), len(argv))
    args = argv[:cut]
    assert args[0] == "actscan", line
    return CliRunner().invoke(app, args[1:]), args


def check_outputs(result: Any, args: list[str], cwd: Path) -> None:
    """Whatever the command promises (stdout data, -o file, --json file) is there and parses."""
    assert result.exit_code in (0, 1), f"{args}: exit {result.exit_code}\n{result.output}"

    def opt(name: str) -> str | None:
        return args[args.index(name) + 1] if name in args else None

    fmt, out, js = opt("--format") or "table", opt("-o") or opt("--output"), opt("--json")
    if js == "-":
        validate_report(json.loads(result.stdout))
    elif js is not None:
        validate_report(json.loads((cwd / js).read_text()))
    text = result.stdout if out in (None, "-") else (cwd / out).read_text()
    if fmt == "json":
        validate_report(json.loads(text))
    elif fmt == "junit":
        assert ET.fromstring(text.encode()).tag == "testsuites"
    elif fmt == "markdown":
        assert text.startswith("### actscan:") and "#### Residual stream" in text


# -- README ↔ examples ------------------------------------------------------------------
def test_readme_shows_the_example_files_verbatim() -> None:
    yamls = blocks("yaml")
    assert yamls == [
        (EXAMPLES / "github-actions.yml").read_text(),
        (EXAMPLES / "pre-commit-config.yaml").read_text(),
    ]
    example = (EXAMPLES / "test_model_health.py").read_text().splitlines()
    (snippet,) = blocks("python")
    lines = iter(example)  # every README line appears in the example file, in order
    for line in filter(str.strip, snippet.splitlines()):
        assert any(line == ex for ex in lines), f"README line not in the example: {line!r}"


def test_readme_toml_is_a_valid_project_config(tmp_path: Path) -> None:
    (toml,) = blocks("toml")
    path = tmp_path / "pyproject.toml"
    path.write_text(toml)
    assert "actscan" in tomllib.loads(toml)["tool"]
    cfg = load_project_config(path)
    assert cfg.values["fail_on"] == "warn" and cfg.values["seq_len"] == 128
    assert [(i.check, i.reason) for i in cfg.ignores] == [
        ("dead-branch", "ReZero: branches start at 0 by design")
    ]
    assert re.search(cfg.ignores[0].layers or "", "blocks.3.attn")


@pytest.mark.slow
def test_readme_console_commands_run(project: Path) -> None:
    (console,) = blocks("console")
    lines = [ln.removeprefix("$ ") for ln in console.splitlines() if ln.startswith("$ actscan")]
    assert len(lines) >= 3
    for line in lines:
        result, args = run_actscan_line(line, project)
        check_outputs(result, args, project)
    result = CliRunner().invoke(app, ["profile", "configs/model.yaml", "--show-config"])
    assert result.exit_code == 0 and "threshold outlier-ratio" in result.stdout


# -- GitHub Actions ---------------------------------------------------------------------
@pytest.mark.slow
def test_github_actions_job_runs(project: Path) -> None:
    workflow = yaml.safe_load((EXAMPLES / "github-actions.yml").read_text())
    steps = workflow["jobs"]["actscan"]["steps"]
    scripts = [s["run"] for s in steps if "actscan profile" in s.get("run", "")]
    assert len(scripts) == 2
    assert "--fail-on warn --format junit -o actscan.xml" in scripts[0]
    assert '--format markdown >> "$GITHUB_STEP_SUMMARY"' in scripts[1]
    publish = next(s for s in steps if "junit" in s.get("uses", ""))
    assert publish["with"]["report_paths"] == "actscan.xml"
    summary = project / "summary.md"
    summary.write_text("")
    env = {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "GITHUB_STEP_SUMMARY": str(summary),
        "OMP_NUM_THREADS": "1",
    }
    env.pop("NO_COLOR", None)
    for script in scripts:  # as GitHub runs a `run:` step: bash -e
        proc = subprocess.run(
            ["bash", "-e", "-c", script],
            cwd=project,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr
        assert "\x1b[" not in proc.stdout + proc.stderr  # not a terminal: plain text
    root = ET.parse(project / "actscan.xml").getroot()
    assert root.get("failures") == "0" and len(root.findall("testsuite/testcase")) >= 11
    text = summary.read_text()
    assert text.startswith("### actscan: `configs/model.yaml`") or text.startswith("### actscan:")
    assert "#### Residual stream" in text and "**PASS** at `--fail-on warn`" in text


# -- pre-commit -------------------------------------------------------------------------
@pytest.mark.slow
def test_pre_commit_hook_runs(project: Path) -> None:
    config = yaml.safe_load((EXAMPLES / "pre-commit-config.yaml").read_text())
    (repo,) = config["repos"]
    (hook,) = repo["hooks"]
    assert repo["repo"] == "local" and hook["language"] == "system"
    assert hook["pass_filenames"] is False
    files = re.compile(hook["files"])
    assert files.search("configs/model.yaml") and files.search("src/mymodel/layers.py")
    assert not files.search("README.md")
    result, args = run_actscan_line(hook["entry"], project)
    check_outputs(result, args, project)
    assert result.exit_code == 0, result.output
    assert "Findings" in result.stdout and "Residual stream" not in result.stdout  # --quiet
    # The hook blocks the commit once a change breaks the model.
    (project / "configs" / "model.yaml").write_text(BROKEN_YAML)
    result, args = run_actscan_line(hook["entry"], project)
    assert result.exit_code == 1, result.output
    assert "WARN" in result.stdout or "ERROR" in result.stdout


# -- pytest -----------------------------------------------------------------------------
@pytest.mark.slow
def test_pytest_example_passes(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-o",
            "addopts=",
            "-p",
            "no:cacheprovider",
            str(EXAMPLES / "test_model_health.py"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 passed" in proc.stdout


def test_pytest_example_catches_a_dead_branch() -> None:
    """The example's assertion has teeth: its model with one branch zeroed fails it."""
    spec = importlib.util.spec_from_file_location("_example", EXAMPLES / "test_model_health.py")
    assert spec and spec.loader
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    from actscan import scan

    torch.manual_seed(0)
    model = example.TinyModel()
    with torch.no_grad():
        model.blocks[3].mlp[-1].weight.zero_()
        model.blocks[3].mlp[-1].bias.zero_()
    report = scan(model, torch.randn(8, 32, 16), loss_fn=lambda out: out.square().mean())
    with pytest.raises(AssertionError, match=r"dead-branch[^\n]*blocks\.3\.mlp"):
        report.assert_healthy(fail_on="warn")
