"""A run whose steps go non-finite is an `overflow` error that names the first step, module
and parameter, and every step check that then has nothing to judge says the run diverged
(issue 19: it used to say "No findings" and exit 0, with untrue skip reasons)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from test_cli_gate import SMALL_RUN, TINY, cli
from test_dynamics import run, tiny

from actscan.diagnose.steps import DYNAMICS_CHECKS, diverged_reason, divergence
from actscan.models.gpt import ActscanGPT
from actscan.records import CheckId, Severity
from actscan.report.report import Report
from actscan.report.schema import validate_report
from actscan.steps.loop import _nonfinite

PLANTED = "blocks.1.mlp.up.weight"
UNTRUE = ("no parameter update ratios", "no output logits", "no attention scores", "found 0")


class BlowsUp(ActscanGPT):
    """The built-in model whose one matrix trains at lr 1e30 with weight decay 1e12: its
    first SGD update (W − lr·(g + wd·W)) writes inf into that matrix from a finite
    gradient, and into nothing else."""

    def actscan_param_groups(self, lr: float) -> list[dict[str, Any]]:
        named = [(n, p) for n, p in self.named_parameters() if p.requires_grad]
        return [
            {"params": [p for n, p in named if n != PLANTED]},
            {"params": [p for n, p in named if n == PLANTED], "lr": 1e30, "weight_decay": 1e12},
        ]


def _planted() -> BlowsUp:
    model = tiny()
    model.__class__ = BlowsUp
    return model  # type: ignore[return-value]


def _overflow(report: Report) -> list[Any]:
    return [f for f in report.findings if f.check == CheckId.OVERFLOW.value]


def test_a_planted_inf_update_names_the_step_the_module_and_the_parameter() -> None:
    report = run(_planted(), steps=3, optimizer="sgd", lr=1e-3)
    d = report.dynamics
    assert d is not None
    # what the records carry: the update after step 0 wrote inf into the planted matrix
    # only; at step 1 the probe's first non-finite output is that block's MLP
    assert d.steps[0].nonfinite == (("update", PLANTED),)
    first_output = d.steps[1].nonfinite[0]
    assert first_output == ("activation", "blocks.1.mlp")
    assert ("activation", "blocks.1.attn") not in d.steps[1].nonfinite
    assert ("loss", "loss") in d.steps[1].nonfinite
    div = divergence(d)
    assert div is not None
    assert (div.t, div.stage, div.name) == (0, "update", PLANTED)
    assert div.module == (1, "blocks.1.mlp")
    assert div.param == (0, "update", PLANTED, 1)
    assert div.loss == 1
    (f,) = [f for f in _overflow(report) if f.severity == Severity.ERROR]
    assert f.layers == ("blocks.1.mlp", PLANTED)
    assert "Training diverged at step 0" in f.message
    assert f"into 1 parameter tensor (first: {PLANTED}) from finite gradients" in f.message
    assert "blocks.1.mlp, at step 1" in f.message
    assert "lower --lr" in f.hint and "clip" in f.hint
    for s in report.skipped:
        assert not any(u in s.reason for u in UNTRUE), s


def test_fp16_adam_divergence_fails_the_gate_and_every_skip_says_diverged(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    res = cli(
        "profile",
        *TINY,
        *SMALL_RUN,
        "--dtype",
        "fp16",
        "--steps",
        "2",
        "--fail-on",
        "error",
        "--json",
        str(out),
    )
    assert res.exit_code == 1, res.output
    doc = json.loads(out.read_text())
    validate_report(doc)
    report = Report.from_dict(doc)
    f = report.findings[0]
    assert (f.check, f.severity) == (CheckId.OVERFLOW.value, Severity.ERROR)
    assert "Training diverged at step 0" in f.message
    assert "from finite gradients" in f.message
    assert "Adam's state are fp16" in f.hint and "--amp bf16" in f.hint
    assert report.dynamics is not None and report.dynamics.steps[0].nonfinite
    skipped = {s.check: s.reason for s in report.skipped if s.check in DYNAMICS_CHECKS}
    for check in ("update-size", "attn-logit-growth", "logit-drift"):
        assert skipped[check].startswith("the run diverged at step 0: "), skipped
    assert not any(u in r for r in skipped.values() for u in UNTRUE), skipped
    assert "No findings" not in res.stdout


def test_a_healthy_run_records_no_non_finite_value() -> None:
    report = run(tiny(), steps=3, lr=1e-3)
    d = report.dynamics
    assert d is not None and len(d.steps) == 4
    assert all(s.nonfinite == () for s in d.steps)
    assert divergence(d) is None and diverged_reason(d, "x") is None
    assert not [f for f in _overflow(report) if f.severity == Severity.ERROR]
    assert all(math.isfinite(s.loss or math.nan) for s in d.steps)


def test_the_flag_is_exact_where_a_half_precision_norm_overflows() -> None:
    """A finite fp16 tensor whose 2-norm overflows is not flagged; inf and nan are."""
    big = torch.full((64,), 60000.0, dtype=torch.float16)
    inf, nan = big.clone(), big.clone()
    inf[3], nan[5] = math.inf, math.nan
    ts = [big, inf, nan, torch.ones(4, dtype=torch.float16)]
    l2 = torch._foreach_norm(ts)
    assert math.isinf(l2[0].item())  # the norm alone would call it non-finite
    flags = _nonfinite(l2, torch._foreach_norm(ts, math.inf))
    assert flags.tolist() == [0.0, 1.0, 1.0, 0.0]


def test_a_report_written_before_the_field_reads_back_finite() -> None:
    doc = run(tiny(), steps=1).to_dict()
    for step in doc["dynamics"]["steps"]:
        del step["nonfinite"]
    back = Report.from_dict(doc)
    assert back.dynamics is not None
    assert all(s.nonfinite == () for s in back.dynamics.steps)
