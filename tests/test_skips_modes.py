"""Issue 11: explicit skips, train-mode runs with dropout off, fp16 underflow, truthful
rendering and the outlier-channels message. Planted cases on tiny models: each assertion
fails if the behaviour breaks."""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import ctx, flat_stream, only, outlier_rec, rec, stream
from rich.console import Console
from torch import nn

from actscan import scan
from actscan.diagnose import evaluate
from actscan.models.arch import build_config
from actscan.models.gpt import build_model
from actscan.records import CheckId, Severity
from actscan.render.formats import to_junit, to_markdown
from actscan.render.sparks import spark
from actscan.render.terminal import render_report
from actscan.report.report import Report
from actscan.report.schema import validate_report
from actscan.targets.stored_dtype import stored_dtype_note


def text_of(report: Report) -> str:
    con = Console(width=200, record=True, color_system=None, file=open("/dev/null", "w"))  # noqa: SIM115
    render_report(report, con)
    return con.export_text()


class GradMul(torch.autograd.Function):
    """Identity forward; multiplies the gradient by `factor` on the way back."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g * ctx.factor, None


class Block(nn.Module):
    def __init__(self, d: int, amplify: float = 1.0) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.amplify = amplify

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.amplify != 1.0:
            x = GradMul.apply(x, self.amplify)
        return x + self.mlp(self.norm(x))


class Residual(nn.Module):
    def __init__(self, n: int = 3, d: int = 16, amplify: float = 1.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        # the gradient leaving block 1 for block 0 is multiplied by `amplify`
        self.blocks = nn.ModuleList(Block(d, amplify if i == 1 else 1.0) for i in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def x16() -> torch.Tensor:
    return torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(1))


# --------------------------------------------------------------------------- skips


def test_three_blocks_lists_the_depth_checks_as_skipped_everywhere() -> None:
    report = scan(Residual(3), x16())
    skipped = {s.check: s.reason for s in report.skipped}
    for check in ("sqrt-growth", "exp-growth", "collapse"):
        assert skipped[check] == "needs 4 blocks, found 3"
    assert "fp16" in skipped["underflow"]
    assert "init-scale" not in skipped  # a module built in code is at init by default
    trained = scan(Residual(3), x16(), at_init=False)
    assert "not at init" in {s.check: s.reason for s in trained.skipped}["init-scale"]
    # the gradient checks run from 2 blocks: not skipped, and quiet on this healthy stack
    assert "vanishing-grad" not in skipped and "exploding-grad" not in skipped
    assert not report.findings
    data = json.loads(report.to_json())
    validate_report(data)
    assert {"check": "collapse", "reason": "needs 4 blocks, found 3"} in data["skipped"]
    assert Report.from_dict(data).skipped == report.skipped
    text = text_of(report)
    assert "No findings: activations and gradients keep a sane scale in the checks that ran" in text
    assert "not checked: underflow, exp-growth, collapse, sqrt-growth" in text
    assert "skipped exp-growth, collapse, sqrt-growth: needs 4 blocks, found 3" in text
    md = to_markdown(report)
    assert "Not checked:" in md and "- `collapse`: needs 4 blocks, found 3" in md
    cases = {c.get("name"): c for c in ET.fromstring(to_junit([report])).iter("testcase")}
    assert cases["collapse"].find("skipped") is not None
    assert cases["collapse"].find("skipped").get("message") == "needs 4 blocks, found 3"  # type: ignore[union-attr]
    assert cases["vanishing-grad"].find("skipped") is None  # it ran: a pass
    suite = ET.fromstring(to_junit([report])).find("testsuite")
    assert suite is not None and suite.get("skipped") == str(len(report.skipped))


def test_no_backward_does_not_claim_gradients_are_sane() -> None:
    report = scan(Residual(4), x16(), backward=False)
    skipped = {s.check: s.reason for s in report.skipped}
    assert (
        skipped["vanishing-grad"] == skipped["exploding-grad"] == "no backward pass (forward only)"
    )
    text = text_of(report)
    assert "activations and gradients keep" not in text
    assert (
        "No findings: activations keep a sane scale (forward only: gradients not measured)" in text
    )


def test_a_1e4_gradient_ratio_over_three_blocks_is_a_finding() -> None:
    report = scan(Residual(3, amplify=1e4), x16())
    f = report.findings[0]
    assert (f.check, f.severity) == (CheckId.EXPLODING_GRAD, Severity.ERROR)
    assert f.value == pytest.approx(1e4, rel=0.5)


def test_two_block_gradient_check_runs_and_one_block_is_skipped() -> None:
    two = evaluate(ctx(points=stream([1.0, 1.0, 1.0], [50.0, 1.0, 1.0])))
    assert [f.check for f in two[0]] == ["exploding-grad"]
    one = evaluate(ctx(points=stream([1.0, 1.0], [50.0, 1.0])))
    assert not only(one[0], "exploding-grad")
    reasons = {s.check: s.reason for s in one[1]}
    assert reasons["exploding-grad"] == "needs 2 blocks with a measured stream gradient, found 1"


def test_no_residual_stream_and_no_channels_are_reasons() -> None:
    c = ctx(points=(), n_blocks=0)
    reasons = {s.check: s.reason for s in evaluate(c)[1]}
    assert reasons["dead-branch"].startswith("no residual stream found")
    assert reasons["sqrt-growth"].startswith("no residual stream found")
    assert reasons["outlier-channels"] == "per-channel statistics were not recorded"
    # a check that ran is never listed as skipped
    c4 = ctx(points=flat_stream(4), at_init=True)
    assert "init-scale" not in {s.check for s in evaluate(c4)[1]}


# --------------------------------------------------------------------------- train mode


class ConvBN(nn.Module):
    """12 × (Conv, BatchNorm2d, ReLU): at init BatchNorm in eval mode is the identity and
    PyTorch's default conv init shrinks the signal; in train mode BN holds it at 1."""

    def __init__(self, n: int = 12) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
            for _ in range(n)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for b in self.blocks:
            x = b(x)
        return x


def test_batchnorm_runs_on_batch_statistics_and_its_running_stats_are_kept() -> None:
    net = ConvBN().eval()
    with torch.no_grad():
        net.blocks[0][1].running_mean.add_(0.25)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    report = scan(net, torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(0)))
    assert (report.run.mode, report.run.dropout) == ("train", False)
    assert not report.findings, report.findings  # eval mode gave a false vanishing-grad
    assert report.summary.gain_per_block == pytest.approx(1.0, abs=0.02)
    for k, v in net.state_dict().items():  # running_mean/var, num_batches_tracked untouched
        assert torch.equal(v, before[k]), k
    assert not any(m.training for m in net.modules())
    assert "train mode, dropout off" in text_of(report)


class Dropped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.5)
        self.attention_dropout = 0.5  # an HF attention module's rate, read when training
        self.scores = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.drop(self.lin(x))
        return self.scores(F.dropout(y, p=self.attention_dropout, training=self.training))


def test_dropout_is_off_by_default_and_on_when_asked() -> None:
    net = Dropped()
    x = torch.randn(8, 16)
    a, b = scan(net, x, seed=1), scan(net, x, seed=2)
    assert a.layer("drop").zero_frac == 0.0 and a.layer("scores").zero_frac == 0.0
    assert a.layer("scores").rms == b.layer("scores").rms  # reproducible
    on = scan(net, x, dropout=True)
    assert on.run.dropout is True and on.layer("drop").zero_frac > 0.2  # type: ignore[operator]
    assert on.layer("scores").zero_frac > on.layer("drop").zero_frac  # type: ignore[operator]
    assert net.drop.p == 0.5 and net.attention_dropout == 0.5 and net.training  # restored


def test_cli_dropout_flag_reaches_the_run(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from actscan.cli import app

    out = tmp_path / "r.json"
    tiny = ["--set", "n_layers=2", "--set", "d_model=32", "--set", "n_heads=2", "--seq-len", "8"]
    res = CliRunner().invoke(
        app, ["profile", "gpt-12-preln", *tiny, "-q", "--dropout", "--json", str(out)]
    )
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert data["run"]["mode"] == "train" and data["run"]["dropout"] is True


# --------------------------------------------------------------------------- underflow


def small_gpt() -> nn.Module:
    cfg = dict(
        n_layers=4,
        d_model=64,
        vocab_size=256,
        init="fan-in",
        branch_scale="depth",
        tie_embeddings=False,
    )
    return build_model(build_config(cfg), seed=0)


def scaled_ce(scale: float) -> Any:
    def loss(out: Any) -> torch.Tensor:
        logits = out if isinstance(out, torch.Tensor) else out[0]
        target = torch.zeros(logits.shape[0] * logits.shape[1], dtype=torch.long)
        return F.cross_entropy(logits.float().flatten(0, 1), target) * scale

    return loss


@pytest.mark.slow
def test_underflow_fires_on_a_tiny_loss_in_fp16_and_not_on_a_healthy_one() -> None:
    model = small_gpt()
    bad = scan(model, loss_fn=scaled_ce(1e-6), dtype="fp16", batch=2, seq_len=32)
    f = only(bad.findings, "underflow")
    assert f and f[0].severity is Severity.ERROR and f[0].value == 1.0
    assert "GradScaler" in f[0].hint and "smallest normal" in f[0].message
    assert "tok_emb" in f[0].layers
    good = scan(model, loss_fn=scaled_ce(1.0), dtype="fp16", batch=2, seq_len=32)
    assert not only(good.findings, "underflow")
    assert all(r.grad_underflow_frac is not None for r in good.layers if r.grad_rms)
    assert any("scales the loss by 4096" in n for n in good.notes)
    fp32 = scan(model, batch=2, seq_len=32)
    assert all(r.underflow_frac is None for r in fp32.layers)
    assert "underflow" in {s.check for s in fp32.skipped}
    # the gradient statistics are unscaled: fp16 and fp32 agree
    assert good.layer("blocks.0").grad_rms == pytest.approx(
        scan(model, loss_fn=scaled_ce(1.0), batch=2, seq_len=32).layer("blocks.0").grad_rms,
        rel=0.05,
    )


def test_underflow_recorder_counts_subnormals_only_and_once_per_tensor() -> None:
    from actscan.measure.recorder import Recorder

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Identity()
            self.b = nn.Identity()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x))

    net = Two()
    x = torch.tensor([[0.0, 1e-6, 3e-5, 1.0]], dtype=torch.float16)
    with Recorder(list(net.named_children()), backward=False, underflow=True) as rec:
        net(x)
        raw = rec.result(1)
    assert raw["a"].underflow == raw["b"].underflow == 2  # 1e-6, 3e-5: not 0, not 1.0


# --------------------------------------------------------------------------- rendering


def test_sparkline_is_flat_within_a_few_percent_and_blank_when_not_measured() -> None:
    assert len(set(spark([1.0, 1.002, 1.004, 1.001]))) == 1  # a 0.4% drift: flat
    assert spark([1.0, 2.0, 4.0])[0] != spark([1.0, 2.0, 4.0])[-1]
    assert spark([1.0, None, 2.0])[1] == " " and spark([1.0, math.inf, 2.0])[1] == "!"


def test_modules_left_out_render_blank_in_the_stream_sparkline() -> None:
    report = scan(Residual(4), x16(), modules=r"blocks\.[02]$")
    assert "!" not in text_of(report).split("Stream:")[1].split("\n")[0]


def test_a_bf16_checkpoint_run_in_fp32_says_so(tmp_path: Path) -> None:
    assert "stored in bf16" in (stored_dtype_note({"checkpoint_dtypes": ["BF16"]}, "fp32") or "")
    assert stored_dtype_note({"checkpoint_dtypes": ["BF16"]}, "bf16") is None
    assert stored_dtype_note({"checkpoint_dtypes": ["float32"]}, "fp32") is None
    from actscan.api import scan_target
    from actscan.targets.checkpoint import save_builtin

    cfg = dict(n_layers=2, d_model=32, n_heads=2, vocab_size=64, seq_len=8)
    path = tmp_path / "m.safetensors"
    save_builtin(build_model(build_config(cfg), seed=0), path, dtype=torch.bfloat16)
    (tmp_path / "m.json").write_text(json.dumps({"family": "actscan-gpt", **cfg}))
    from actscan.settings import Settings

    report = scan_target(str(path), Settings(batch=1)).report
    assert any("stored in bf16; this run is fp32" in n for n in report.notes), report.notes


# --------------------------------------------------------------------------- outlier message


def test_outlier_message_does_not_merge_widths_or_count_aliases() -> None:
    narrow = [outlier_rec(f"blocks.{i}.out", 30.0 + i, (33,), order=2 + 2 * i) for i in range(3)]
    wide_fields = dict(
        channel_max_ratio=40.0,
        outlier_channels=(856,),
        channel_median_max=3.0,
        max_abs=120.0,
        n_channels=1536,
        order=1,
    )
    wide = rec("blocks.0.mlp.act", **wide_fields)
    alias = rec("blocks.0.mlp.drop", **wide_fields)  # the same tensor, reported twice
    c = ctx(points=flat_stream(4), layers=[wide, alias, *narrow])
    f = only(evaluate(c)[0], "outlier-channels")[0]
    assert f.message.startswith(
        "Activation channel 856 stands out in 1 layer of width 1536 (first: blocks.0.mlp.act)"
    ), f.message
    assert "channel 33 in 3 layers of width 64 (first: blocks.0.out)" in f.message
