"""Project defaults: discovery of actscan.toml / [tool.actscan], validation, merging, ignores."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from actscan.errors import ConfigError
from actscan.records import Finding, Severity
from actscan.settings import (
    Ignore,
    ProjectConfig,
    apply_ignores,
    effective_settings,
    find_project_config,
    load_project_config,
)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """tmp_path/a/b/c, returned as the innermost folder."""
    deep = tmp_path / "a" / "b" / "c"
    deep.mkdir(parents=True)
    return deep


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


# -- discovery --------------------------------------------------------------------------
def test_pyproject_found_from_nested_folder(tmp_path, tree):
    pyproject = write(
        tmp_path / "a" / "pyproject.toml",
        '[project]\nname = "x"\n\n[tool.actscan]\nfail-on = "warn"\nseq-len = 32\n',
    )
    cfg = find_project_config(tree)
    assert cfg.path == pyproject.resolve()
    assert cfg.values == {"fail_on": "warn", "seq_len": 32}
    assert cfg.ignores == ()


def test_pyproject_without_table_is_skipped(tmp_path, tree):
    write(tmp_path / "a" / "b" / "pyproject.toml", '[project]\nname = "x"\n[tool.ruff]\n')
    outer = write(tmp_path / "a" / "pyproject.toml", '[tool.actscan]\ndtype = "bf16"\n')
    cfg = find_project_config(tree)
    assert cfg.path == outer.resolve()
    assert cfg.values == {"dtype": "bf16"}


def test_broken_unrelated_pyproject_is_skipped(tmp_path, tree):
    write(tmp_path / "a" / "b" / "pyproject.toml", "[project\nname=")
    outer = write(tmp_path / "a" / "actscan.toml", "batch = 4\n")
    assert find_project_config(tree).path == outer.resolve()


def test_actscan_toml_in_nearer_folder_wins(tmp_path, tree):
    write(tmp_path / "a" / "pyproject.toml", '[tool.actscan]\ndtype = "fp16"\n')
    near = write(tmp_path / "a" / "b" / "actscan.toml", 'dtype = "bf16"\n')
    cfg = find_project_config(tree)
    assert cfg.path == near.resolve()
    assert cfg.values == {"dtype": "bf16"}  # first hit wins: files are not merged


def test_actscan_toml_wins_in_same_folder(tmp_path, tree):
    write(tree / "pyproject.toml", '[tool.actscan]\ndtype = "fp16"\n')
    write(tree / "actscan.toml", '[tool.actscan]\ndtype = "bf16"\n')  # nested form works too
    cfg = find_project_config(tree)
    assert cfg.path.name == "actscan.toml"
    assert cfg.values == {"dtype": "bf16"}


def test_nothing_found(tree, monkeypatch):
    monkeypatch.chdir(tree)
    cfg = find_project_config()
    # A real file above tmp_path would be found too; there normally is none.
    if cfg.path is None:
        assert cfg == ProjectConfig(path=None)
    assert ProjectConfig(path=None).values == {}


def test_default_start_is_cwd(tmp_path, tree, monkeypatch):
    write(tmp_path / "a" / "actscan.toml", "seed = 3\n")
    monkeypatch.chdir(tree)
    assert find_project_config().values == {"seed": 3}


# -- validation -------------------------------------------------------------------------
def test_all_known_keys(tmp_path):
    path = write(
        tmp_path / "actscan.toml",
        """
fail-on = "never"
dtype = "fp32"
amp = "bf16"
batch = 2
seq-len = 16
batches = 3
seed = 0
device = "auto"
modules = "h\\\\.\\\\d+\\\\.mlp"
thresholds = { sqrt-growth = 4, outlier-ratio = 6.5 }
[[ignore]]
check = "dead-branch"
layers = "ls\\\\d"
reason = "LayerScale starts at 0"
""",
    )
    cfg = load_project_config(path)
    assert cfg.values == {
        "fail_on": "never",
        "dtype": "fp32",
        "amp": "bf16",
        "batch": 2,
        "seq_len": 16,
        "batches": 3,
        "seed": 0,
        "device": "auto",
        "modules": r"h\.\d+\.mlp",
        "thresholds": {"sqrt-growth": 4.0, "outlier-ratio": 6.5},
    }
    assert cfg.ignores == (
        Ignore(check="dead-branch", reason="LayerScale starts at 0", layers=r"ls\d"),
    )


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ("[tool.actscan]\nfial-on = 'warn'\n", "'fial-on'"),
        ("[tool.actscan]\nseq_len = 4\n", "did you mean 'seq-len'"),
        ("[tool.actscan]\nfail-on = 'fatal'\n", "fail-on must be one of"),
        ("[tool.actscan]\nbatch = '4'\n", "batch must be an integer"),
        ("[tool.actscan]\nbatch = 0\n", "batch must be at least 1"),
        ("[tool.actscan]\nbatches = true\n", "batches must be an integer"),
        ("[tool.actscan]\nmodules = '(unclosed'\n", "modules is an invalid regex"),
        ("[tool.actscan]\nthresholds = { x = 'big' }\n", "thresholds entry 'x'"),
        ("[tool.actscan]\nthresholds = 3\n", "thresholds must be a table"),
        ("[tool.actscan]\nignore = [{ check = 'dead-branch' }]\n", "ignore[0] needs reason"),
        ("[tool.actscan]\nignore = [{ check = 'dead-branch', reason = ' ' }]\n", "needs reason"),
        (
            "[tool.actscan]\nignore = [{ check = 'nope', reason = 'r' }]\n",
            "'nope' is not a check id",
        ),
        ("[tool.actscan]\nignore = [{ check = 'collapse', reason = 'r', why = 1 }]\n", "'why'"),
        (
            "[tool.actscan]\nignore = [{ check = 'collapse', reason = 'r', layers = '[' }]\n",
            "layers",
        ),
        ("[tool.actscan]\nignore = { check = 'collapse' }\n", "ignore must be a list"),
        ("[tool.actscan\n", "invalid TOML"),
        ("[tool]\nactscan = 3\n", "[tool.actscan] must be a table"),
    ],
)
def test_bad_pyproject_names_file_and_key(tmp_path, body, fragment):
    path = write(tmp_path / "pyproject.toml", body)
    with pytest.raises(ConfigError) as info:
        find_project_config(tmp_path)
    message = str(info.value)
    assert str(path.resolve()) in message
    assert fragment in message


def test_unknown_key_in_actscan_toml(tmp_path):
    write(tmp_path / "actscan.toml", "colour = 'red'\n")
    with pytest.raises(ConfigError, match=r"actscan\.toml: unknown key 'colour'"):
        find_project_config(tmp_path)


def test_actscan_toml_mixing_forms_is_an_error(tmp_path):
    path = write(tmp_path / "actscan.toml", "batch = 2\n[tool.actscan]\nseed = 1\n")
    with pytest.raises(ConfigError, match="mixes"):
        load_project_config(path)


def test_config_error_exit_code():
    assert ConfigError("x").exit_code == 2


# -- effective settings -----------------------------------------------------------------
def test_effective_settings_provenance(tmp_path):
    path = write(
        tmp_path / "pyproject.toml",
        '[tool.actscan]\nfail-on = "warn"\ndtype = "bf16"\nthresholds = { a = 2.0, b = 3.0 }\n',
    )
    project = load_project_config(path)
    defaults = {"fail_on": "error", "dtype": "fp32", "batch": 4, "thresholds": {"a": 1.0, "c": 9.0}}
    cli = {"fail_on": "info", "dtype": None, "seq-len": 8, "thresholds": {"b": 5.0}}
    got = effective_settings(cli, project, defaults)
    src = str(path)
    assert got["fail_on"] == ("info", "command line")
    assert got["dtype"] == ("bf16", src)
    assert got["batch"] == (4, "default")
    assert got["seq_len"] == (8, "command line")
    assert got["thresholds"] == (
        {"a": 2.0, "b": 5.0, "c": 9.0},
        f"command line + {src} + default",
    )
    assert got["thresholds.a"] == (2.0, src)
    assert got["thresholds.b"] == (5.0, "command line")
    assert got["thresholds.c"] == (9.0, "default")


def test_effective_settings_without_project():
    got = effective_settings({"seed": None}, ProjectConfig(path=None), {"seed": 0})
    assert got == {"seed": (0, "default")}


# -- ignores ----------------------------------------------------------------------------
def _finding(check: str, *layers: str) -> Finding:
    return Finding(check, Severity.WARN, layers, 0.0, 0.0, f"{check} on {layers}")


def test_apply_ignores_by_check_and_regex():
    findings = (
        _finding("dead-branch", "blocks.0.ls1", "blocks.0.ls2"),
        _finding("dead-branch", "blocks.1.attn"),
        _finding("collapse"),
        _finding("overflow", "head"),
    )
    ignores = (
        Ignore(check="dead-branch", reason="LayerScale at 0 by design", layers=r"\.ls\d$"),
        Ignore(check="collapse", reason="known, tracked in #12"),
        Ignore(check="overflow", reason="only on lm_head", layers="lm_head"),
    )
    kept, ignored = apply_ignores(findings, ignores)
    assert kept == (findings[1], findings[3])
    assert ignored == (
        (findings[0], "LayerScale at 0 by design"),
        (findings[2], "known, tracked in #12"),
    )


def test_ignore_with_layers_does_not_match_layerless_finding():
    kept, ignored = apply_ignores(
        (_finding("collapse"),), (Ignore(check="collapse", reason="r", layers="."),)
    )
    assert len(kept) == 1
    assert ignored == ()


# -- the frozen Settings ----------------------------------------------------------------
def test_settings_precedence_cli_over_file_over_default(tmp_path):
    import dataclasses

    from actscan.settings import Settings

    path = write(
        tmp_path / "pyproject.toml",
        '[tool.actscan]\nfail-on = "warn"\ndtype = "bf16"\nseq-len = 16\n'
        "thresholds = { outlier-ratio = 9, growth_warn = 5 }\n"
        'ignore = [{ check = "collapse", reason = "known" }]\n',
    )
    cli = {
        "fail_on": None,
        "dtype": "fp16",
        "batch": None,
        "seq_len": None,
        "seed": 7,
        "thresholds": {"outlier_ratio": "3"},
    }
    s = Settings.resolve(cli, load_project_config(path))
    src = str(path)
    assert (s.fail_on, s.source("fail_on")) == ("warn", src)  # CLI gave None: the file
    assert (s.dtype, s.source("dtype")) == ("fp16", "command line")  # CLI beats the file
    assert (s.seq_len, s.source("seq-len")) == (16, src)
    assert (s.seed, s.source("seed")) == (7, "command line")
    assert (s.batch, s.source("batch")) == (4, "default")
    assert (s.device, s.source("device")) == ("auto", "default")
    # thresholds merge per name; each keeps its own source; values are floats
    assert dict(s.thresholds) == {"outlier-ratio": 3.0, "growth-warn": 5.0}
    assert s.source("thresholds.outlier-ratio") == "command line"
    assert s.source("thresholds.growth-warn") == src
    assert s.threshold_set().outlier_ratio == 3.0 and s.threshold_set().outlier_abs == 0.0
    assert s.ignores == (Ignore(check="collapse", reason="known"),)
    assert s.source("ignore") == src and s.project == path
    today = [
        "fail_on",
        "dtype",
        "amp",
        "batch",
        "seq_len",
        "batches",
        "seed",
        "device",
        "modules",
        "dropout",
        "steps",
        "optimizer",
        "lr",
        "eps",
        "weight_decay",
        "warmup",
        "attention",
    ]
    assert [k for k in s.run_values() if k in today] == today  # a new setting may join them
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.batch = 2  # type: ignore[misc]
    with pytest.raises(TypeError):
        s.thresholds["outlier-ratio"] = 1.0  # type: ignore[index]


def test_settings_without_project_and_from_python():
    from actscan.settings import Settings

    s = Settings.resolve({"batch": 2}, ProjectConfig(path=None))
    assert s.project is None and s.ignores == ()
    assert (s.batch, s.source("batch")) == (2, "command line")
    assert s.source("fail_on") == "default"
    direct = Settings(fail_on="warn", thresholds={"outlier_abs": 2})
    assert direct.source("fail_on") == "python" and direct.source("batch") == "default"
    assert dict(direct.thresholds) == {"outlier-abs": 2.0}
    assert direct.source("thresholds.outlier-abs") == "python"


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"batch": 0}, "Settings(batch=...) must be at least 1"),
        ({"fail_on": "sometimes"}, "Settings(fail_on=...) must be one of"),
        ({"thresholds": {"no-such": 1}}, "unknown threshold 'no-such'"),
        ({"thresholds": {"outlier-ratio": -1}}, "non-negative"),
        ({"ignores": ({"check": "collapse"},)}, "needs reason"),
    ],
)
def test_settings_validate_once_when_built(kwargs, fragment):
    from actscan.errors import UsageError
    from actscan.settings import Settings

    with pytest.raises(UsageError, match=re.escape(fragment)):
        Settings(**kwargs)


def test_settings_errors_name_the_source(tmp_path):
    from actscan.errors import UsageError
    from actscan.settings import Settings

    path = write(tmp_path / "actscan.toml", "thresholds = { no-such = 1.0 }\n")
    with pytest.raises(UsageError, match=rf"^{re.escape(str(path))} \[thresholds\]: unknown"):
        Settings.resolve({}, load_project_config(path))
    with pytest.raises(UsageError, match=r"^--threshold: threshold 'outlier-ratio' must be a"):
        Settings.resolve({"thresholds": {"outlier-ratio": "x"}}, ProjectConfig(path=None))
    with pytest.raises(UsageError, match=r"^--modules is an invalid regex"):
        Settings.resolve({"modules": "("}, ProjectConfig(path=None))
