"""Several residual streams: each block list of an encoder-decoder is a stream of its own,
found without a per-family table, fitted and judged on its own (the transformers families
are in test_family_matrix.py; here small modules make each rule fail on purpose)."""

from __future__ import annotations

import io
import json

import pytest
import torch
from rich.console import Console
from torch import nn

from actscan import scan
from actscan.layout.detect import detect_layout, find_streams
from actscan.models.arch import ArchConfig
from actscan.records import CheckId, Severity
from actscan.render.formats import to_markdown
from actscan.render.terminal import render_report
from actscan.report.report import Report

D = 16


class Block(nn.Module):
    """Pre-norm MLP block; with `cross`, a third write from the encoder's output. `gain`
    multiplies the block's output (a planted geometric growth when > 1)."""

    def __init__(self, cross: bool = False, gain: float = 1.0) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))
        self.cross = nn.Linear(D, D) if cross else None
        self.gain = gain

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.mlp(self.norm(x))
        if self.cross is not None and memory is not None:
            x = x + self.cross(memory)
        return x * self.gain if self.gain != 1.0 else x


class Seq2Seq(nn.Module):
    def __init__(self, n: int = 4, enc_gain: float = 1.0) -> None:
        super().__init__()
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(Block(gain=enc_gain) for _ in range(n))
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleList(Block(cross=True) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for b in self.encoder.layers:
            h = b(h)
        y = x.flip(1)
        for b in self.decoder.layers:
            y = b(y, h)
        return y


def _scan(model: nn.Module) -> Report:
    torch.manual_seed(0)
    return scan(model, torch.randn(2, 8, D))


def test_two_block_lists_are_two_streams_named_from_their_paths() -> None:
    torch.manual_seed(0)
    model = Seq2Seq()
    assert [(n, c) for n, c, _ in find_streams(model)] == [
        ("encoder", "encoder.layers"),
        ("decoder", "decoder.layers"),
    ]
    layout = detect_layout(model)
    assert [b.index for b in layout.blocks] == list(range(8))
    assert layout.block_label(5) == "decoder block 1"

    report = _scan(model)
    enc, dec = report.streams
    assert [p.k for p in enc.points] == [0, 1, 2, 3, 4]
    assert [p.k for p in dec.points] == [0, 2, 4, 6, 8]  # MLP + cross-attention
    assert {p.roles for p in report.layout if p.stream == "decoder"} == {("mlp", "cross_attn")}
    assert report.stream == dec.points
    assert not [f for f in report.findings if f.severity is not Severity.INFO]


def test_depth_checks_run_per_stream_and_name_its_blocks() -> None:
    """×3 per encoder block: exp-growth in the encoder stream only, named there; the
    decoder stream (fed by the grown encoder only through its cross writes) is judged on
    its own fit."""
    report = _scan(Seq2Seq(enc_gain=3.0))
    growth = [f for f in report.findings if f.check == CheckId.EXP_GROWTH]
    assert len(growth) == 1, report.findings
    assert all(name.startswith("encoder.layers.") for name in growth[0].layers)
    assert "encoder block 3" in growth[0].message
    enc, dec = report.streams
    assert enc.summary.gain_per_block == pytest.approx(3.0, rel=0.05)
    assert dec.summary.gain_per_block != pytest.approx(3.0, rel=0.05)


def test_a_stream_too_short_for_a_check_is_listed_as_skipped_there() -> None:
    model = Seq2Seq()
    model.encoder.layers = nn.ModuleList(list(model.encoder.layers)[:2])
    report = _scan(model)
    skipped = {s.check: s.reason for s in report.skipped}
    assert skipped[CheckId.SQRT_GROWTH.value] == "encoder stream: needs 4 blocks, found 2"


def test_lists_nested_in_other_lists_stay_one_stream() -> None:
    """Stages of blocks (Swin-like): the longest list is inside another block list."""

    class Staged(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stages = nn.ModuleList(nn.Module() for _ in range(2))
            for i, st in enumerate(self.stages):
                st.blocks = nn.ModuleList(Block() for _ in range(3 + i))

    model = Staged()
    assert [(n, c) for n, c, _ in find_streams(model)] == [("main", "stages.1.blocks")]
    assert detect_layout(model).streams == ()


def test_tables_and_markdown_show_each_stream() -> None:
    report = _scan(Seq2Seq())
    out = io.StringIO()
    render_report(report, Console(file=out, width=160, color_system=None))
    text = out.getvalue()
    assert "Residual stream: encoder (encoder.layers)" in text
    assert "Residual stream: decoder (decoder.layers)" in text
    assert "Stream encoder: RMS" in text and "Stream decoder: RMS" in text
    assert "decoder 1   cross_attn" in text
    md = to_markdown(report)
    assert "#### Residual stream: encoder" in md and "#### Residual stream: decoder" in md


def test_single_stream_reports_are_unchanged() -> None:
    """A one-stream model: `streams` is empty and `stream` keeps its points and keys."""
    from actscan.models.gpt import ActscanGPT

    torch.manual_seed(0)
    model = ActscanGPT(ArchConfig(n_layers=4, d_model=32, n_heads=2, vocab_size=64, seq_len=16))
    data = json.loads(scan(model, batch=2, seq_len=8).to_json())
    assert data["streams"] == []
    assert [p["k"] for p in data["stream"]] == [0, 2, 4, 6, 8]
    assert set(data["stream"][0]) == {
        "k",
        "block",
        "name",
        "rms",
        "grad_rms",
        "mean",
        "std",
        "max_abs",
        "top_values",
        "median_abs",
        "token_grad_rel",
        "token_grad_median",
    }
    assert {p["stream"] for p in data["layout"]} == {"main"}
