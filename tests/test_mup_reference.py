"""μP checked against the reference: the built-in `parametrization: mup` next to the same
architecture parametrized by Microsoft's `mup` package (MuSharedReadout, set_base_shapes,
mup.init, MuAdamW), built by benchmarks/mup_reference.py.

The built-in parametrization is right if it *is* mup's: the same init std and Adam rate
per parameter, the same forward, so the same coordinates step by step from the same
weights; with each drawing its own weights, the coordinate slopes agree to the seed
scatter. actscan's coordinate check must then be quiet on both and flag SP, at 4 and 12
blocks. docs/checks.md#coord-check ("μP against the reference") has the full table.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from actscan.records import Severity

pytest.importorskip("mup")

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "mup_reference.py"
_spec = importlib.util.spec_from_file_location("mup_reference", _PATH)
assert _spec is not None and _spec.loader is not None
ref = importlib.util.module_from_spec(_spec)
sys.modules["mup_reference"] = ref  # dataclasses resolve their module by name
_spec.loader.exec_module(ref)

BASE = 32
WIDTHS = (32, 64, 128)
SMALL = (("vocab_size", 128), ("seq_len", 16))
# Largest difference allowed between the two implementations' seed-mean group slopes
# (4 seeds, every group and t, |x| and Δ RMS): measured ≤ 0.08 at 4 and 12 blocks, lr 1e-3
# and 3e-3; a parametrization error moves a slope by ≥ 0.35 (the planted double division
# of the hidden rate, benchmarks/mup_reference.py "overdivided").
SLOPE_TOLERANCE = 0.15


def pair(width: int, depth: int = 2, seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Module]:
    kw = dict(SMALL)
    return (
        ref.builtin_model(width, depth, seed, BASE, **kw),
        ref.mup_model(width, depth, seed, BASE, **kw),
    )


def test_builtin_mup_has_mups_init_rule_and_adam_rates_per_parameter() -> None:
    for width in (64, 128):
        builtin, reference = pair(width)
        ours, theirs = dict(builtin.named_parameters()), dict(reference.named_parameters())
        assert ours.keys() == theirs.keys()
        lr = 1e-2
        our_lr = {id(p): g["lr"] for g in builtin.actscan_param_groups(lr) for p in g["params"]}
        mup_lr = {id(p): g["lr"] for g in reference.actscan_param_groups(lr) for p in g["params"]}
        for name, p in ours.items():
            q = theirs[name]
            assert our_lr[id(p)] == pytest.approx(mup_lr[id(q)], rel=1e-12), name
            if p.std() == 0 or q.std() == 0:  # biases 0, norm gains 1
                assert torch.equal(p, q), name
            else:  # drawn: two independent samples of one rule (≥ 1024 values each)
                assert p.std().item() == pytest.approx(q.std().item(), rel=0.1), name
        # the readout's 1/width_mult and the attention's attn_mult/d_head
        assert builtin.head.mult == pytest.approx(1 / reference.head.width_mult())
        assert builtin.blocks[0].attn.scale == pytest.approx(reference.blocks[0].attn.scale)
        hidden = [n for n in ours if our_lr[id(ours[n])] < lr]
        assert hidden and all(n.startswith("blocks.") and ours[n].ndim == 2 for n in hidden)
        assert our_lr[id(ours["blocks.0.attn.qkv.weight"])] == pytest.approx(lr * BASE / width)


def test_from_the_same_weights_both_take_the_same_steps() -> None:
    """Same forward, same rates: three AdamW steps at lr 1e-2 give the same coordinates
    (to fp32 rounding), so a slope difference can only come from the draws."""
    builtin, reference = pair(128)
    reference.load_state_dict(builtin.state_dict())
    ids = ref.tokens(128, 2, 16, seed=0)
    a = ref.measure(builtin, ids, 1e-2, 3)
    b = ref.measure(reference, ids, 1e-2, 3)
    assert a.names == b.names and a.values.shape == (4, len(a.names), 4)
    np.testing.assert_allclose(a.values, b.values, rtol=1e-4, atol=1e-7)
    assert a.loss[-1] < a.loss[0]  # it trained


def test_the_hooks_measure_what_mups_own_coord_check_records() -> None:
    """mup's `get_coord_data` (MuAdamW, its default betas) on the reference gives the
    same mean |x| per module and step as this harness, which measures the built-in the
    same way: from the same weights, all three agree."""
    from mup.coord_check import get_coord_data

    builtin = ref.builtin_model(64, 2, 0, BASE, **dict(SMALL))
    ids = ref.tokens(128, 2, 16, seed=0)
    x, y = ids[:, :-1], ids[:, 1:].reshape(-1)

    def lazy() -> torch.nn.Module:
        model = ref.mup_model(64, 2, 0, BASE, **dict(SMALL))
        model.load_state_dict(builtin.state_dict())
        return model

    df = get_coord_data(
        {64: lazy}, [(x, y)], optimizer="adamw", lr=1e-2, mup=True, nsteps=3,
        flatten_output=True, cuda=False, show_progress=False,
    )  # fmt: skip
    theirs = ref.measure(lazy(), ids, 1e-2, 2, betas=(0.9, 0.999))
    ours = ref.measure(builtin, ids, 1e-2, 2, betas=(0.9, 0.999))  # trains it: last
    for i, name in enumerate(ours.names):
        if name == "blocks.0.in":  # an input, which get_coord_data does not record
            continue
        l1 = df[df.module == name].sort_values("t").l1.to_numpy()
        assert l1.shape == (3,), name
        np.testing.assert_allclose(theirs.values[:, i, 1], l1, rtol=1e-5, err_msg=name)
        np.testing.assert_allclose(ours.values[:, i, 1], l1, rtol=1e-4, err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("depth", [4, 12])
def test_coordinate_slopes_agree_with_mup(depth: int) -> None:
    means = {}
    for impl in ("builtin", "mup"):
        runs = [
            ref.coord_slopes(ref.RefSweep(impl, WIDTHS, depth, s, 1e-3, 3, BASE, 2, SMALL))
            for s in range(4)
        ]
        means[impl] = {
            (q, key): float(np.mean([r[q][key] for r in runs]))
            for q in ("rms", "d_rms")
            for key in runs[0][q]
        }
    ours, theirs = means["builtin"], means["mup"]
    assert ours.keys() == theirs.keys() and len(ours) == 5 * 4 + 5 * 3
    worst = max(ours, key=lambda k: abs(ours[k] - theirs[k]))
    assert abs(ours[worst] - theirs[worst]) <= SLOPE_TOLERANCE, worst
    for slopes in (ours, theirs):  # and both are flat: blocks ±0.3, logits from −0.5 at t = 0
        assert all(-0.3 <= v <= 0.3 for (_, (g, _t)), v in slopes.items() if g != "head")
        assert slopes[("rms", ("head", 0))] == pytest.approx(-0.5, abs=0.1)


@pytest.mark.slow
@pytest.mark.parametrize("depth", [4, 12])
def test_actscan_coord_check_is_quiet_on_both_mup_and_flags_sp(depth: int) -> None:
    checks = {
        impl: ref.actscan_check(ref.RefSweep(impl, WIDTHS, depth, 0, 1e-3, 2, BASE, 2, SMALL))
        for impl in ("builtin", "mup", "sp")
    }
    assert checks["builtin"].findings == () and checks["mup"].findings == ()
    (grows,) = checks["sp"].findings
    assert grows.severity is Severity.WARN and "grow with width 32→128" in grows.message
    assert grows.value > 1.0 and math.isfinite(grows.value)
