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

import contextlib
import copy
import json
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from bounded_cli import run_batch
from typer.testing import CliRunner

from actscan.cli import app
from actscan.errors import BadInputError, ConfigError
from actscan.files import CONFIG_CAP
from actscan.models.arch import read_config_file

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


@pytest.mark.slow
def test_yaml_alias_bomb_is_refused_while_composed(results) -> None:
    refused(results["alias-bomb"], "bomb.yaml", "more than 100000 nodes once its aliases")


@pytest.mark.slow
def test_fifo_config_is_refused_unopened(results) -> None:
    refused(results["fifo-yaml"], "fifo.yaml", "is a FIFO", "not a regular file")
    refused(results["hf-fifo-config"], "config.json", "is a FIFO")


@pytest.mark.slow
def test_symlink_to_dev_zero_is_refused_unread(results) -> None:
    refused(results["dev-zero-yaml"], "zero.yaml", "is a character device")


@pytest.mark.slow
def test_config_past_the_cap_names_the_cap(results) -> None:
    refused(results["config-over-cap"], "big.yaml", "more than the 4 MiB")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "params"), [("n_layers-1e9", "3.28e+12"), ("d_model-1e6", "1.2e+13")]
)
def test_memory_estimate_refuses_before_building(results, case: str, params: str) -> None:
    line = refused(results[case], "this model needs about", "available", "--force")
    assert params in line


@pytest.mark.slow
def test_hf_config_deeper_than_its_weights_is_refused_before_building(results) -> None:
    refused(
        results["hf-20000-layers"],
        "num_hidden_layers=20000",
        "layers up to 1 only",
        "'model.layers.2.'",
    )
    assert results["hf-good"]["code"] in (0, 1), results["hf-good"]  # the same weights load


@pytest.mark.slow
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


# -- the pieces, in process (fast; the batch above runs them end to end) ------------------
@contextlib.contextmanager
def hang_guard(seconds: float = 30.0) -> Iterator[None]:
    """SIGALRM after `seconds`: a blocking open or read raises instead of waiting forever."""

    def alarm(_signum: int, _frame: object) -> None:
        raise TimeoutError(f"still blocked after {seconds} s")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_only_regular_files_are_opened(tmp_path: Path) -> None:
    from actscan.files import read_bounded

    os.mkfifo(tmp_path / "fifo.yaml")
    (tmp_path / "zero.yaml").symlink_to("/dev/zero")
    (tmp_path / "dir.yaml").mkdir()
    (tmp_path / "loop.yaml").symlink_to(tmp_path / "loop.yaml")
    with hang_guard():
        for name, reason in [
            ("fifo.yaml", "is a FIFO"),
            ("zero.yaml", "is a character device"),
            ("dir.yaml", "is a directory"),
            ("loop.yaml", "cannot read: Too many levels of symbolic links"),
            ("missing.yaml", "file not found"),
        ]:
            with pytest.raises(ConfigError, match=f"^{re.escape(str(tmp_path / name))}: {reason}"):
                read_config_file(tmp_path / name)
    path = tmp_path / "big.json"
    path.write_bytes(b" " * (CONFIG_CAP + 1))
    with pytest.raises(BadInputError, match="is more than the 4 MiB actscan reads from a"):
        read_bounded(path, cap=CONFIG_CAP)
    assert read_bounded(path, cap=CONFIG_CAP + 1) == b" " * (CONFIG_CAP + 1)


def test_yaml_aliases_are_counted_and_nesting_is_bounded(tmp_path: Path) -> None:
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(BOMB)
    with pytest.raises(ConfigError, match="more than 100000 nodes once its aliases are expanded"):
        read_config_file(bomb)
    fine = tmp_path / "anchors.yaml"
    fine.write_text("d_model: &w 16\nmup_base_width: *w\nblock: &b {a: 1}\nother: *b\n")
    assert read_config_file(fine) == {
        "d_model": 16, "mup_base_width": 16, "block": {"a": 1}, "other": {"a": 1}
    }  # fmt: skip
    for suffix, text in [
        (".json", "[" * 100_000 + "]" * 100_000),
        (".yaml", "[" * 5_000 + "]" * 5_000),
        (".toml", "a = " + "[" * 5_000 + "]" * 5_000),
    ]:
        path = tmp_path / f"deep{suffix}"
        path.write_text(text)
        with pytest.raises(ConfigError, match="nested too deeply"):
            read_config_file(path)


def test_the_parameter_count_is_exact_without_building() -> None:
    """Two meta builds (depth 1 and 2) give the real model's count at any depth."""
    from actscan.models.arch import ArchConfig
    from actscan.models.gpt import build_model
    from actscan.targets.builtin import builtin_shape

    for cfg in (
        ArchConfig(n_layers=3, d_model=32, n_heads=4, vocab_size=64, seq_len=16),
        ArchConfig(n_layers=5, d_model=16, n_heads=2, vocab_size=32, seq_len=8,
                   activation="swiglu", position="rope", tie_embeddings=False),
    ):  # fmt: skip
        model = build_model(cfg)
        real = {id(t): t.numel() for t in (*model.parameters(), *model.buffers())}
        assert builtin_shape(cfg, "x").numel == sum(real.values())


def test_the_estimate_grows_with_what_the_run_holds() -> None:
    from actscan.targets.footprint import RunPlan, Shape, estimate

    shape = Shape(numel=10**6, n_layers=4, d_model=8, n_heads=2, vocab=10)
    run = {"device": "cpu", "batch": 1, "seq_len": 4}  # activations of a few KiB
    forward = estimate(shape, RunPlan(backward=False, **run)).host
    backward = estimate(shape, RunPlan(**run)).host
    steps = estimate(shape, RunPlan(steps=3, **run)).host
    assert 4 * 10**6 < forward < backward < steps
    assert backward - forward >= 4 * 10**6  # fp32 gradients
    assert steps - backward >= 12 * 10**6  # kept weights + Adam's two moments
    half = estimate(shape, RunPlan(dtype="bf16", backward=False, **run)).host
    assert half >= 6 * 10**6  # the bf16 copy beside the fp32 build
    wide = Shape(numel=10**6, n_layers=4, d_model=1024, n_heads=16, vocab=50_000)
    assert estimate(wide, RunPlan(**run)).host > backward + 4 * 50_000 * 8  # the logits


def test_hf_config_is_held_to_its_weights_on_the_meta_device() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from actscan.targets.hf import _from_config
    from actscan.targets.hf_check import check_weights, meta_plan

    config = LlamaConfig(
        num_hidden_layers=3, hidden_size=16, intermediate_size=32, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=64, max_position_embeddings=32,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    weights = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    plan = meta_plan(config, _from_config)
    real = {id(t): t.numel() for t in (*model.parameters(), *model.buffers())}
    assert plan.shape.numel == sum(real.values())
    check_weights(plan, weights, "w")  # the weights it describes pass
    deep = copy.deepcopy(config)
    deep.num_hidden_layers = 20000
    with pytest.raises(BadInputError, match=r"num_hidden_layers=20000 .* up to 2 only"):
        check_weights(meta_plan(deep, _from_config), weights, "w")
    wide = copy.deepcopy(config)
    wide.intermediate_size = 48
    with pytest.raises(BadInputError, match=r"mis-shaped 6 \('model.layers.0.mlp.down_proj"):
        check_weights(meta_plan(wide, _from_config), weights, "w")
