"""Say what is not measured (issue 19, defect 8): nothing is silently misread.

- a block applied more than once per forward (weight sharing, a universal transformer's
  loop) is one stream point merging its applications: the report says so, naming the
  block and the count;
- a `--modules` regex that matches nothing is exit 2, not a run with every check skipped;
- config values outside their domain (a negative eps, zero heads, a size of 0 or -1) are
  exit 2 naming the field, for the built-in configs and for Hugging Face configs alike;
- an `--input` that exists but is no regular file says what it is, not "not found"; a
  `config.json` that is a symlink loop says so, not "no config.json".
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from helpers import one_line_error
from torch import nn
from typer.testing import CliRunner

from actscan import scan
from actscan.cli import app

TINY = "n_layers: 2\nd_model: 32\nn_heads: 4\nvocab_size: 64\nseq_len: 16\n"
FAST = ["--batch", "2", "--seq-len", "8", "--device", "cpu", "-q", "--no-backward"]


def cli(*args: object):
    return CliRunner().invoke(app, [str(a) for a in args])


# -- a block applied more than once per forward ------------------------------------------
class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.ln(x))


class Looped(nn.Module):
    """A universal transformer: its blocks, applied `k` times over."""

    def __init__(self, blocks: list[nn.Module], k: int = 1, d: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, d)
        self.blocks = nn.ModuleList(blocks)
        self.k = k
        self.head = nn.Linear(d, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for _ in range(self.k):
            for b in self.blocks:
                x = b(x)
        return self.head(x)


class OneBlock(nn.Module):
    """One block module (no list) applied three times."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, d)
        self.block = Block(d)
        self.head = nn.Linear(d, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for _ in range(3):
            x = self.block(x)
        return self.head(x)


def notes_of(model: nn.Module) -> list[str]:
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (2, 8))
    report = scan(model, inputs=ids, loss_fn=lambda out: out.float().pow(2).mean(), batches=2)
    return [n for n in report.notes if "more than once per forward" in n]


def test_a_looped_stack_says_its_stream_merges_the_applications() -> None:
    torch.manual_seed(0)
    notes = notes_of(Looped([Block(32) for _ in range(3)], k=2))
    assert len(notes) == 1, notes
    for needle in ("blocks.0 (Block) ×2", "blocks.2 (Block) ×2", "3 points for 6 applied blocks"):
        assert needle in notes[0], notes[0]
    assert "blocks.0.mlp" not in notes[0]  # the block is named, not each of its children


def test_a_block_listed_twice_is_named_with_its_count() -> None:
    torch.manual_seed(0)
    shared = Block(32)
    notes = notes_of(Looped([shared, Block(32), shared]))
    assert len(notes) == 1 and "blocks.0 (Block) ×2" in notes[0], notes
    assert "2 points for 3 applied blocks" in notes[0]


def test_a_shared_module_outside_the_stack_is_named() -> None:
    torch.manual_seed(0)
    notes = notes_of(OneBlock())
    assert len(notes) == 1 and "block (Block) ×3" in notes[0], notes


def test_no_note_when_every_module_runs_once() -> None:
    torch.manual_seed(0)
    assert notes_of(Looped([Block(32) for _ in range(3)])) == []


# -- --modules that matches nothing --------------------------------------------------------
def test_modules_matching_nothing_is_exit_2(tmp_path: Path) -> None:
    (tmp_path / "tiny.yaml").write_text(TINY)
    result = cli("profile", tmp_path / "tiny.yaml", *FAST, "--modules", "^nothing_here$")
    one_line_error(result, "--modules", "'^nothing_here$'", "blocks.0")


def test_modules_matching_something_still_runs(tmp_path: Path) -> None:
    (tmp_path / "tiny.yaml").write_text(TINY)
    result = cli("profile", tmp_path / "tiny.yaml", *FAST, "--modules", "mlp", "--fail-on", "never")
    assert result.exit_code == 0, result.output


# -- config values outside their domain -----------------------------------------------------
@pytest.mark.parametrize(
    ("change", "field"),
    [("norm_eps: -1", "norm_eps"), ("norm_eps: 0", "norm_eps")],
)
def test_builtin_config_out_of_domain_names_the_field(
    tmp_path: Path, change: str, field: str
) -> None:
    (tmp_path / "bad.yaml").write_text(TINY + change + "\n")
    one_line_error(cli("profile", tmp_path / "bad.yaml", *FAST), field)


def test_builtin_set_out_of_domain_names_the_field(tmp_path: Path) -> None:
    (tmp_path / "tiny.yaml").write_text(TINY)
    one_line_error(
        cli("profile", tmp_path / "tiny.yaml", *FAST, "--set", "norm_eps=-1"), "norm_eps"
    )


def _hf(folder: Path, model_type: str, **change: object) -> Path:
    transformers = pytest.importorskip("transformers")
    small = {
        "llama": dict(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            vocab_size=100,
            max_position_embeddings=64,
        ),
        "gpt2": dict(n_embd=32, n_layer=2, n_head=2, vocab_size=100, n_positions=64),
    }[model_type]
    data = {**transformers.AutoConfig.for_model(model_type, **small).to_dict(), **change}
    path = folder / "config.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(
    ("model_type", "change"),
    [
        ("llama", {"num_attention_heads": 0}),
        ("llama", {"hidden_size": 0}),
        ("llama", {"num_hidden_layers": 0}),
        ("llama", {"max_position_embeddings": -2}),
        ("llama", {"intermediate_size": -5}),
        ("gpt2", {"n_head": 0}),
    ],
    ids=lambda v: v if isinstance(v, str) else next(iter(v)),
)
def test_hf_config_out_of_domain_names_the_field(
    tmp_path: Path, model_type: str, change: dict[str, object]
) -> None:
    """Checked before transformers sees them: a zero or negative size is no model (main
    built a 0-wide model and reported findings, or ran 0 layers with exit 0)."""
    (field,) = change
    one_line_error(cli("profile", _hf(tmp_path, model_type, **change), *FAST), field, "positive")


def test_hf_set_out_of_domain_names_the_field(tmp_path: Path) -> None:
    config = _hf(tmp_path, "llama")
    result = cli("profile", config, *FAST, "--set", "max_position_embeddings=0")
    one_line_error(result, "max_position_embeddings")


# -- what a path is, when it is not what was expected -------------------------------------
def test_a_fifo_input_is_called_a_fifo(tmp_path: Path) -> None:
    """(Said since the bounded reads of actscan/files.py: kept here as the defect's test.)"""
    (tmp_path / "tiny.yaml").write_text(TINY)
    os.mkfifo(tmp_path / "ids.json")
    line = one_line_error(
        cli("profile", tmp_path / "tiny.yaml", *FAST, "--input", tmp_path / "ids.json")
    )
    assert "FIFO" in line and "not found" not in line


def test_a_config_json_symlink_loop_is_called_a_loop(tmp_path: Path) -> None:
    """(Said since the bounded reads of actscan/files.py: kept here as the defect's test.)"""
    folder = tmp_path / "model"
    folder.mkdir()
    os.symlink("config.json", folder / "config.json")
    line = one_line_error(cli("profile", folder, *FAST))
    assert "no config.json" not in line and "symbolic links" in line


def test_a_target_symlink_loop_is_called_a_loop(tmp_path: Path) -> None:
    os.symlink("self.yaml", tmp_path / "self.yaml")
    one_line_error(cli("profile", tmp_path / "self.yaml", *FAST), "symlink loop")
