"""One classifier of TARGET strings (targets/classify.py), shared by profile, sweep and the
sharded build, and the one ModelInfo of the built-in family (targets/info.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from actscan.errors import BadInputError, ConfigError, UsageError
from actscan.targets.classify import Kind, classify, shipped_configs

ROOT = Path(__file__).resolve().parents[1]
BUILTIN_YAML = "n_layers: 2\nd_model: 32\nn_heads: 4\nvocab_size: 64\nseq_len: 16\n"


def test_each_kind(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(BUILTIN_YAML)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    (tmp_path / "w.safetensors").write_bytes(b"")
    (tmp_path / "w.bin").write_bytes(b"")
    assert classify("mymodels:build").kind is Kind.CALLABLE
    assert classify("mymodels:build").path is None
    builtin = classify(str(tmp_path / "a.yaml"))
    assert builtin.kind is Kind.BUILTIN_CONFIG and builtin.config_dict()["n_layers"] == 2
    hf = classify(str(tmp_path / "config.json"))
    assert hf.kind is Kind.HF_CONFIG and hf.config_dict()["model_type"] == "gpt2"
    assert hf.is_config and not classify(str(tmp_path)).is_config
    assert classify(str(tmp_path)).kind is Kind.FOLDER
    assert classify(str(tmp_path / "w.safetensors")).kind is Kind.SAFETENSORS
    assert classify(str(tmp_path / "w.bin")).kind is Kind.OTHER


def test_a_shipped_name_is_its_config_file() -> None:
    name, path = next(iter(shipped_configs().items()))
    what = classify(name)
    assert what.shipped and what.path == path and what.is_config


def test_an_existing_path_wins_over_module_callable(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    Path("odd:name.yaml").write_text(BUILTIN_YAML)
    assert classify("odd:name.yaml").kind is Kind.BUILTIN_CONFIG
    assert classify("odd:name").kind is Kind.CALLABLE  # no such path: a callable


def test_naming_nothing_is_one_line_listing_the_shipped_configs() -> None:
    with pytest.raises(BadInputError, match=r"no such file or folder: nope\.yaml \(shipped"):
        classify("nope.yaml")
    with pytest.raises(BadInputError, match="no such file or folder"):
        classify("C:\\models\\x.yaml")  # a Windows path, not module:callable


def test_a_broken_config_is_its_config_error(tmp_path: Path) -> None:
    (tmp_path / "bad.toml").write_text("n_layers = [")
    with pytest.raises(ConfigError):
        classify(str(tmp_path / "bad.toml"))


def test_classify_loads_no_torch() -> None:
    code = "import actscan.targets.classify, sys; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_consumers_refuse_a_callable_each_in_its_own_words() -> None:
    from actscan.compare.sweep import base_config
    from actscan.distributed.build import build_sharded
    from actscan.targets.resolved import TargetOptions

    with pytest.raises(UsageError, match="sweep needs a config"):
        base_config("mymodels:build", {})
    with pytest.raises(UsageError, match="cannot be profiled distributed"):
        build_sharded("mymodels:build", TargetOptions(), None)  # type: ignore[arg-type]


def test_builtin_info_is_one_description(tmp_path: Path) -> None:
    """A config target and the same model handed over in code describe it alike; only the
    config target records the whole config."""
    from actscan.targets.info import infer_info
    from actscan.targets.resolve import resolve

    (tmp_path / "a.yaml").write_text(BUILTIN_YAML)
    resolved = resolve(str(tmp_path / "a.yaml"))
    direct = infer_info(resolved.model, source=str(tmp_path / "a.yaml"))
    config = resolved.info.arch["config"]
    assert config["n_layers"] == 2 and config["d_model"] == 32
    assert "config" not in direct.arch
    assert direct.arch == {k: v for k, v in resolved.info.arch.items() if k != "config"}
    assert (direct.family, direct.n_params, direct.n_blocks, direct.task) == (
        resolved.info.family,
        resolved.info.n_params,
        resolved.info.n_blocks,
        resolved.info.task,
    )
