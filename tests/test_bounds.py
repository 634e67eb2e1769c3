"""Inputs are bounded before they are trusted: a hostile or mistaken config or input file
ends in one line and exit 2, at once, instead of exhausting time or memory.

Each case once ran for minutes or until memory ran out with no message (a YAML alias
bomb: 90 s and 6 GB; a FIFO named .yaml: forever; a .yaml link to /dev/zero: until out
of memory; `n_layers: 1000000000`: no output in 120 s; an HF config.json claiming 20,000
layers beside 2-layer weights: 201 s and 3 GB). They run in one child process under an
address-space limit, each with a hang guard far above what it takes now
(tests/bounded_cli.py), so a regression fails instead of hanging the suite.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from bounded_cli import run_batch
from typer.testing import CliRunner

from actscan.cli import app
from actscan.files import CONFIG_CAP

TINY = "n_layers: 1\nd_model: 16\nn_heads: 2\nvocab_size: 32\nseq_len: 8\n"
FAST = ["--device", "cpu", "--batch", "1", "--seq-len", "8", "--no-backward", "--quiet"]

BOMB = "\n".join(
    [
        'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]',
        *(
            f"{b}: &{b} [{', '.join([f'*{a}'] * 9)}]"
            for a, b in zip("abcdefgh", "bcdefghi", strict=True)
        ),
        "n_layers: *i",
    ]
)


def _hf_folder(root: Path) -> tuple[Path, Path]:
    """(a tiny 2-layer Llama folder, its copy whose config.json claims 20,000 layers)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        num_hidden_layers=2,
        hidden_size=16,
        intermediate_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=64,
        max_position_embeddings=32,
    )
    good, deep = root / "llama", root / "llama-deep"
    LlamaForCausalLM(config).save_pretrained(good)
    deep.mkdir()
    for f in good.iterdir():
        (deep / f.name).write_bytes(f.read_bytes())
    data = json.loads((deep / "config.json").read_text())
    (deep / "config.json").write_text(json.dumps({**data, "num_hidden_layers": 20000}))
    return good, deep


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    root = tmp_path_factory.mktemp("bounds")
    (root / "bomb.yaml").write_text(BOMB)
    os.mkfifo(root / "fifo.yaml")
    (root / "zero.yaml").symlink_to("/dev/zero")
    (root / "deep-layers.yaml").write_text(TINY.replace("n_layers: 1", "n_layers: 1000000000"))
    (root / "wide.yaml").write_text(TINY.replace("d_model: 16", "d_model: 1000000"))
    (root / "big.yaml").write_text(TINY + "#" * CONFIG_CAP)
    (root / "tiny.yaml").write_text(TINY)
    (root / "nested.json").write_text("[" * 100_000 + "]" * 100_000)
    os.mkfifo(root / "fifo.json")
    good, deep = _hf_folder(root)
    fifo_folder = root / "fifo-folder"
    fifo_folder.mkdir()
    (fifo_folder / "model.safetensors").write_bytes((good / "model.safetensors").read_bytes())
    os.mkfifo(fifo_folder / "config.json")
    tiny = str(root / "tiny.yaml")
    cases = {
        "alias-bomb": ["profile", str(root / "bomb.yaml"), *FAST],
        "fifo-yaml": ["profile", str(root / "fifo.yaml"), *FAST],
        "dev-zero-yaml": ["profile", str(root / "zero.yaml"), *FAST],
        "n_layers-1e9": ["profile", str(root / "deep-layers.yaml"), *FAST],
        "d_model-1e6": ["profile", str(root / "wide.yaml"), *FAST],
        "config-over-cap": ["profile", str(root / "big.yaml"), *FAST],
        "hf-20000-layers": ["profile", str(deep), *FAST],
        "hf-fifo-config": ["profile", str(fifo_folder), *FAST],
        "input-nested": ["profile", tiny, "--input", str(root / "nested.json"), *FAST],
        "input-fifo": ["profile", tiny, "--input", str(root / "fifo.json"), *FAST],
        "hf-good": ["profile", str(good), *FAST],
    }
    return run_batch(cases, per_case=60.0)


def refused(result: dict[str, Any], *needles: str) -> str:
    assert result["code"] == 2, result
    lines = [ln for ln in result["stderr"].splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("actscan: error: "), result
    assert "Traceback" not in result["stderr"] + result["stdout"]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_yaml_alias_bomb_is_refused_while_composed(results) -> None:
    refused(results["alias-bomb"], "bomb.yaml", "aliases expand past 100000 nodes")


def test_fifo_config_is_refused_unopened(results) -> None:
    refused(results["fifo-yaml"], "fifo.yaml", "is a FIFO", "not a regular file")
    refused(results["hf-fifo-config"], "config.json", "is a FIFO")


def test_symlink_to_dev_zero_is_refused_unread(results) -> None:
    refused(results["dev-zero-yaml"], "zero.yaml", "is a character device")


def test_config_past_the_cap_names_the_cap(results) -> None:
    refused(results["config-over-cap"], "big.yaml", "more than the 4 MiB")


@pytest.mark.parametrize(("case", "params"), [("n_layers-1e9", "3.28e+12"), ("d_model-1e6", "")])
def test_memory_estimate_refuses_before_building(results, case: str, params: str) -> None:
    line = refused(results[case], "this model needs about", "available", "--force")
    assert params in line


def test_hf_config_deeper_than_its_weights_is_refused_before_building(results) -> None:
    refused(
        results["hf-20000-layers"],
        "num_hidden_layers=20000",
        "layers up to 1 only",
        "'model.layers.2.'",
    )
    assert results["hf-good"]["code"] in (0, 1), results["hf-good"]  # the same weights load


def test_input_files_are_bounded(results) -> None:
    refused(results["input-nested"], "--input", "nested.json", "nested too deeply")
    refused(results["input-fifo"], "--input", "fifo.json", "is a FIFO")


def test_force_builds_what_the_estimate_refuses(tmp_path: Path, monkeypatch) -> None:
    """--force: the estimate still runs, the refusal does not (a machine with 1 KiB)."""
    from actscan.targets import footprint

    monkeypatch.setattr(footprint, "available", lambda device: 1024)
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY)
    result = CliRunner().invoke(app, ["profile", str(path), *FAST])
    assert result.exit_code == 2 and "has 1 KiB available" in result.stderr, result.output
    result = CliRunner().invoke(app, ["profile", str(path), *FAST, "--force"])
    assert result.exit_code in (0, 1), result.output
