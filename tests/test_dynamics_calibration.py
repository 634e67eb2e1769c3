"""Key rows of docs/calibration-dynamics.md, pinned on the smallest configurations: a real
`scan(steps=10)` of a tiny built-in model on a memorisation task at a too-high and a sane
learning rate, and the dynamics check that must (or must not) fire. The full grid is
benchmarks/calibrate_dynamics.py (minutes; not part of the suite)."""

from __future__ import annotations

import pytest
import torch

from actscan import scan
from actscan.diagnose.steps import DYNAMICS_CHECKS
from actscan.models.arch import ArchConfig
from actscan.models.gpt import build_model
from actscan.records import CheckId, Severity

DATA = torch.randint(64, (16, 16), generator=torch.Generator().manual_seed(0))


def batches(i: int) -> torch.Tensor:
    """Batch i: 8 of 16 fixed sequences (the calibration's memorisation task, smaller)."""
    g = torch.Generator().manual_seed(i)
    return DATA[torch.randint(len(DATA), (8,), generator=g)]


def fired(placement: str, lr: float, *, qk: bool = False, layers: int = 4) -> dict[str, str]:
    cfg = ArchConfig(
        n_layers=layers,
        d_model=32,
        n_heads=2,
        vocab_size=64,
        seq_len=16,
        placement=placement,
        qk_norm=qk,
    )
    report = scan(build_model(cfg), inputs=batches, steps=10, lr=lr)
    assert report.dynamics is not None and len(report.dynamics.steps) == 11
    return {
        f.check: str(f.severity)
        for f in report.findings
        if f.check in DYNAMICS_CHECKS and f.severity in (Severity.WARN, Severity.ERROR)
    }


@pytest.mark.slow
def test_sane_lr_is_quiet_on_both_placements() -> None:
    assert fired("pre", 1e-3) == {}
    assert fired("post", 1e-3) == {}


@pytest.mark.slow
def test_lr_300x_too_high_flags_attention_growth_and_qk_norm_removes_it() -> None:
    """Pre-LN at lr 0.3: the attention scores grow ×10⁵ in 10 steps, to thousands (past
    the ground truth's failing runs, ≥ 442); QK-norm bounds them (≈ 20), and the check
    stays quiet while update-size still flags the lr."""
    assert CheckId.ATTN_LOGIT_GROWTH.value in fired("pre", 0.3)
    qk = fired("pre", 0.3, qk=True)
    assert CheckId.ATTN_LOGIT_GROWTH.value not in qk and CheckId.UPDATE_SIZE.value in qk


def test_post_ln_at_a_too_high_lr_flags_the_update_size() -> None:
    got = fired("post", 3e-2)
    assert got.get(CheckId.UPDATE_SIZE.value) in ("warn", "error")


@pytest.mark.parametrize("qk", [False, True])
def test_amplification_is_skipped_on_a_shallow_stack(qk: bool) -> None:
    cfg = ArchConfig(n_layers=2, d_model=32, n_heads=2, vocab_size=64, seq_len=16, qk_norm=qk)
    report = scan(build_model(cfg), inputs=batches, steps=2, lr=1e-3)
    reasons = {s.check: s.reason for s in report.skipped}
    assert reasons[CheckId.AMPLIFICATION.value].startswith("needs the probe's change at 12")
