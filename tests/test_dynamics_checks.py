"""The dynamics checks (update-size, amplification, attn-logit-growth, logit-drift,
adam-epsilon) on synthetic Dynamics records: each fires on its pathology, stays quiet on
a healthy record, and skips with a reason when there is nothing to judge."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from helpers import ctx, only

from actscan.diagnose import CheckContext, evaluate
from actscan.diagnose.steps import DYNAMICS_CHECKS, NO_STEPS, numbers, statistics
from actscan.diagnose.thresholds import DEFAULT
from actscan.numfmt import num as n
from actscan.records import (
    ChangeRecord,
    CheckId,
    Dynamics,
    LayerRecord,
    LogitStats,
    OptimizerInfo,
    Severity,
    StepRecord,
    UpdateRecord,
)

N_BLOCKS = 12
STEPS = 5


def change_curve(kind: str, t: int) -> list[float]:
    """rel per block output at step t: 'post' linear in depth, 'pre' saturating."""
    scale = t / STEPS
    if kind == "post":
        return [scale * 0.05 * (b + 1) for b in range(N_BLOCKS)]
    return [scale * 0.4 * min(1.0, (b + 1) / 2) for b in range(N_BLOCKS)]


def dyn(
    *,
    curve: str = "pre",
    ratio: float = 0.05,
    attn: tuple[float, float] = (0.2, 1.0),
    log_z: tuple[float, float] = (4.85, 4.8),
    grad: float = 1e-3,
    optimizer: str = "adamw",
    eps: float = 1e-8,
    lr: float = 1e-3,
    frozen: str | None = None,
    outlier: str | None = None,
    loss_drop: float = 0.1,
    drift: float | None = None,
    step_rms: tuple[float, float] | None = None,
    logit_max: tuple[float, float] = (3.0, 3.0),
) -> Dynamics:
    """A synthetic record; `drift`: every matrix's ‖W_t − W_0‖/‖W_0‖ after the last step
    (reached linearly), `step_rms`: its update per coordinate ÷ lr at the first and last
    step (None: not recorded, as in reports of earlier versions)."""
    steps = []
    for t in range(STEPS + 1):
        f = t / STEPS
        rels = change_curve(curve, t)
        change = (
            ChangeRecord(name="blocks.0:input", kind="stream", k=0, block=None, rel=0.0),
            *(
                ChangeRecord(name=f"blocks.{b}", kind="stream", k=2 * (b + 1), block=b, rel=r)
                for b, r in enumerate(rels)
            ),
        )
        z = log_z[0] + f * (log_z[1] - log_z[0])
        steps.append(
            StepRecord(
                t=t,
                loss=4.8 - loss_drop * t,
                lr=lr,
                change=change,
                logits=LogitStats(
                    max=logit_max[0] + f * (logit_max[1] - logit_max[0]),
                    log_z_mean=z,
                    log_z_std=0.1,
                ),
                attn_max=attn[0] * (attn[1] / attn[0]) ** f,
            )
        )
    updates = []
    for b in range(N_BLOCKS):
        for name in ("attn.qkv", "attn.proj", "mlp.up", "mlp.down"):
            param = f"blocks.{b}.{name}.weight"
            r = 0.0 if param == frozen else ratio * (20 if param == outlier else 1)
            updates.append(
                UpdateRecord(
                    param=param,
                    block=b,
                    role=name.split(".")[0],
                    kind="weight",
                    ratio=(r,) * STEPS,
                    grad_rms=(grad,) * STEPS,
                    numel=4096,
                    drift=() if drift is None else tuple(drift * t / STEPS for t in range(1, 6)),
                    step_rms=()
                    if step_rms is None
                    else tuple(
                        lr * step_rms[0] * (step_rms[1] / step_rms[0]) ** (i / (STEPS - 1))
                        for i in range(STEPS)
                    ),
                )
            )
        updates.append(
            UpdateRecord(
                param=f"blocks.{b}.norm1.bias",
                block=b,
                role="norm",
                kind="bias",
                ratio=(math.inf,) + (0.5,) * (STEPS - 1),
                grad_rms=(grad,) * STEPS,
            )
        )
    opt = OptimizerInfo(
        name=optimizer,
        lr=lr,
        betas=None if optimizer == "sgd" else (0.9, 0.95),
        eps=None if optimizer == "sgd" else eps,
    )
    return Dynamics(optimizer=opt, steps=tuple(steps), updates=tuple(updates))


ATTN_LAYERS = [
    LayerRecord(
        name=f"blocks.{b}.attn.logits", type="AttentionLogits", role="attn", block=b, calls=1
    )
    for b in range(N_BLOCKS)
] + [LayerRecord(name="head", type="Linear", role="head", block=None, calls=1)]


def with_dyn(d: Dynamics | None, **arch: object) -> CheckContext:
    return replace(ctx(n_blocks=N_BLOCKS, layers=ATTN_LAYERS, arch=dict(arch)), dynamics=d)


def findings(d: Dynamics | None, check: CheckId, **arch: object) -> list:
    found, skips = evaluate(with_dyn(d, **arch))
    assert not [s for s in skips if s.check == check.value], skips
    return only(found, check.value)


def test_every_dynamics_check_skips_without_steps() -> None:
    found, skips = evaluate(with_dyn(None))
    assert not [f for f in found if f.check in DYNAMICS_CHECKS]
    reasons = {s.check: s.reason for s in skips}
    for check in DYNAMICS_CHECKS:
        assert reasons[check] == NO_STEPS
    assert NO_STEPS == "no optimizer steps (--steps 0)"


def test_healthy_record_is_quiet() -> None:
    found, skips = evaluate(with_dyn(dyn()))
    assert not [f for f in found if f.check in DYNAMICS_CHECKS]
    assert not [s for s in skips if s.check in DYNAMICS_CHECKS]


def test_update_size_fires_on_large_updates_and_names_blocks() -> None:
    warn = findings(dyn(ratio=DEFAULT.update_ratio_warn * 1.2, lr=1e-2), CheckId.UPDATE_SIZE)
    assert [f.severity for f in warn] == [Severity.WARN]
    assert "blocks 0–11" in warn[0].message and "Lower the learning rate" in warn[0].hint
    assert warn[0].value == pytest.approx(DEFAULT.update_ratio_warn * 1.2)
    err = findings(dyn(ratio=DEFAULT.update_ratio_error * 1.5, lr=3e-2), CheckId.UPDATE_SIZE)
    assert err[0].severity is Severity.ERROR
    below = findings(dyn(ratio=DEFAULT.update_ratio_warn * 0.8), CheckId.UPDATE_SIZE)
    assert not below


def test_update_size_frozen_and_outlier() -> None:
    frozen = findings(dyn(frozen="blocks.3.mlp.up.weight"), CheckId.UPDATE_SIZE)
    assert [(f.severity, f.layers) for f in frozen] == [
        (Severity.WARN, ("blocks.3.mlp.up.weight",))
    ]
    assert "did not move" in frozen[0].message
    small = DEFAULT.update_ratio_warn / 40  # ×20 stays below the warn threshold
    out = findings(dyn(ratio=small, outlier="blocks.5.attn.proj.weight"), CheckId.UPDATE_SIZE)
    assert [(f.severity, f.layers) for f in out] == [
        (Severity.INFO, ("blocks.5.attn.proj.weight",))
    ]
    assert "block 5" in out[0].message


def test_amplification_separates_post_ln_from_pre_ln_shape() -> None:
    post = findings(dyn(curve="post"), CheckId.AMPLIFICATION, placement="post")
    assert len(post) == 1 and post[0].value == pytest.approx(1.0)  # rel ∝ depth
    assert "Post-LN" in post[0].message and "blocks.11" in post[0].layers
    assert post[0].severity is Severity.INFO
    assert not findings(dyn(curve="pre"), CheckId.AMPLIFICATION)  # saturates: ratio 0


def test_amplification_skips_on_a_shallow_stack() -> None:
    d = dyn()
    d = replace(
        d,
        steps=tuple(
            replace(s, change=tuple(c for c in s.change if (c.k or 0) <= 4)) for s in d.steps
        ),
    )
    _, skips = evaluate(with_dyn(d))
    reason = {s.check: s.reason for s in skips}[CheckId.AMPLIFICATION.value]
    assert reason == "needs the probe's change at 12 block outputs, found 2"


def test_attn_logit_growth() -> None:
    warn = findings(dyn(attn=(0.2, DEFAULT.attn_logit_warn * 1.5)), CheckId.ATTN_LOGIT_GROWTH)
    assert [f.severity for f in warn] == [Severity.WARN]
    assert "QK-norm" in warn[0].hint and "blocks.0.attn.logits" in warn[0].layers
    err = findings(dyn(attn=(0.2, DEFAULT.attn_logit_cap * 1.6)), CheckId.ATTN_LOGIT_GROWTH)
    assert err[0].severity is Severity.ERROR and err[0].threshold == DEFAULT.attn_logit_cap
    # large from the start but not growing: the init's scale (logit-scale's business)
    assert not findings(dyn(attn=(12.0, 14.0)), CheckId.ATTN_LOGIT_GROWTH)
    assert not findings(dyn(attn=(0.2, 3.0)), CheckId.ATTN_LOGIT_GROWTH)
    d = dyn()
    d = replace(d, steps=tuple(replace(s, attn_max=None) for s in d.steps))
    _, skips = evaluate(with_dyn(d))
    assert {s.check: s.reason for s in skips}[CheckId.ATTN_LOGIT_GROWTH.value] == (
        "no attention scores were recorded"
    )


def with_layers(d: Dynamics, series: dict[str, tuple[float, float]]) -> Dynamics:
    """Per-layer maxima growing geometrically from a to b; attn_max is their max."""
    steps = []
    for s in d.steps:
        f = s.t / STEPS
        layers = tuple((name, a * (b / a) ** f) for name, (a, b) in series.items())
        steps.append(replace(s, attn_layers=layers, attn_max=max(v for _, v in layers)))
    return replace(d, steps=tuple(steps))


def test_attn_logit_growth_names_the_layers_that_grew() -> None:
    warn_at = DEFAULT.attn_logit_warn
    series = {
        "blocks.0.attn": (0.2, 1.0),  # quiet
        "blocks.3.attn": (0.2, warn_at * 1.5),  # grew past the warn level
        "blocks.7.attn": (warn_at * 1.2 / 8.6, warn_at * 1.2),  # past warn, grown only ×8.6
    }
    warn = findings(with_layers(dyn(), series), CheckId.ATTN_LOGIT_GROWTH)
    assert [f.severity for f in warn] == [Severity.WARN]
    assert warn[0].layers == ("blocks.3.attn",)
    assert "in blocks.3.attn (block 3) (0.2 at step 0)" in warn[0].message
    assert "the only one of 3 attention layers" in warn[0].message
    cap = DEFAULT.attn_logit_cap
    series = {
        "blocks.0.attn": (0.2, 1.0),
        "blocks.3.attn": (0.2, cap * 1.2),
        "blocks.7.attn": (0.3, cap * 1.8),
    }
    err = findings(with_layers(dyn(), series), CheckId.ATTN_LOGIT_GROWTH)
    assert err[0].severity is Severity.ERROR
    assert err[0].layers == ("blocks.7.attn", "blocks.3.attn")  # largest first
    assert f"2 of 3 attention layers are past the cap of {n(cap)}: blocks 3–7" in err[0].message
    quiet = {"blocks.0.attn": (0.2, 1.0), "blocks.1.attn": (12.0, 14.0)}
    assert not findings(with_layers(dyn(), quiet), CheckId.ATTN_LOGIT_GROWTH)


def test_logit_drift() -> None:
    """A warning when log Z moves further than the loss fell (here the loss is flat);
    the same drift while the loss falls as much is how a model learns a peaked
    distribution on real text: info, with the number."""
    rise = DEFAULT.log_z_excess * 2
    flat = findings(dyn(log_z=(4.85, 4.85 + rise), loss_drop=0.0), CheckId.LOGIT_DRIFT)
    assert [f.severity for f in flat] == [Severity.WARN]
    assert "z-loss" in flat[0].hint and "1e-4" in flat[0].hint
    assert flat[0].value == pytest.approx(rise)
    learns = findings(dyn(log_z=(4.85, 4.85 + rise), loss_drop=rise / STEPS), CheckId.LOGIT_DRIFT)
    assert [f.severity for f in learns] == [Severity.INFO]
    assert learns[0].value == pytest.approx(rise) and "under the" in learns[0].message
    assert not findings(dyn(log_z=(4.85, 4.5)), CheckId.LOGIT_DRIFT)


def _from_init(d: Dynamics, at_init: bool = True) -> list:
    c = with_dyn(d)
    found, _ = evaluate(replace(c, info=replace(c.info, at_init=at_init)))
    return only(found, CheckId.LOGIT_DRIFT.value)


def test_logit_peak_warns_when_the_top_logit_runs_away_from_log_z() -> None:
    """The largest logit after an update far above the mean log Z (a few positions' logits
    ran away: their own log Z rises with them, the mean does not) is a warning for a model
    at init, whatever log Z's mean drift; short of the threshold, or only before any
    update, it is not; for a checkpoint (no evidence there) it is info."""
    peak = DEFAULT.logit_peak_warn
    z = (4.85, 4.85)  # the mean log Z stays put: log-z-drift is silent
    ran = _from_init(dyn(log_z=z, logit_max=(3.0, 4.85 + 1.5 * peak)))
    assert [f.severity for f in ran] == [Severity.WARN]
    assert ran[0].value == pytest.approx(1.5 * peak) and ran[0].threshold == peak
    assert f"After step {STEPS}" in ran[0].message and "ran away" in ran[0].message
    assert "Lower the learning rate" in ran[0].hint
    ckpt = _from_init(dyn(log_z=z, logit_max=(3.0, 4.85 + 1.5 * peak)), at_init=False)
    assert [f.severity for f in ckpt] == [Severity.INFO] and "checkpoint" in ckpt[0].message
    assert not _from_init(dyn(log_z=z, logit_max=(3.0, 4.85 + 0.9 * peak)))
    # only t ≥ 1 counts: an init's peak that the first update removes is not judged
    d = dyn(log_z=z)
    s0 = d.steps[0]
    assert s0.logits is not None
    big0 = replace(s0, logits=replace(s0.logits, max=4.85 + 3 * peak))
    assert not _from_init(replace(d, steps=(big0, *d.steps[1:])))
    # an init's peak that the updates leave in place: warned, with the init's remedy
    kept = _from_init(dyn(log_z=z, logit_max=(4.85 + 2 * peak, 4.85 + 1.5 * peak)))
    assert [f.severity for f in kept] == [Severity.WARN]
    assert "at init and the updates have not brought it down" in kept[0].message
    assert "readout smaller" in kept[0].hint
    both = _from_init(
        dyn(log_z=(4.85, 4.85 + 2 * DEFAULT.log_z_excess), loss_drop=0.0, logit_max=(3.0, 60.0))
    )
    assert [f.threshold for f in both] == [DEFAULT.log_z_excess, peak]


def test_adam_epsilon() -> None:
    low = findings(dyn(grad=5e-8), CheckId.ADAM_EPSILON)
    assert [f.severity for f in low] == [Severity.WARN]
    assert low[0].value == pytest.approx(1.0)  # every matrix: the whole model
    assert "5× eps" in low[0].message and "1e-15" in low[0].hint
    assert not findings(dyn(grad=1e-3), CheckId.ADAM_EPSILON)
    # a larger eps makes the same gradients too small for it
    assert findings(dyn(grad=1e-3, eps=1e-3), CheckId.ADAM_EPSILON)
    _, skips = evaluate(with_dyn(dyn(optimizer="sgd")))
    assert {s.check: s.reason for s in skips}[CheckId.ADAM_EPSILON.value] == (
        "not an Adam-family optimizer (sgd)"
    )


def test_adam_epsilon_warns_on_the_update_collapse_not_the_gradient_size() -> None:
    """With the update recorded (step_rms): gradients at 5 × eps whose Adam step is still
    ~80 % of the first (top-layer q/k of healthy runs) are info; the same gradients with
    the update collapsed to a few % of the first are the warning."""
    near = findings(dyn(grad=5e-8, step_rms=(1.0, 0.8)), CheckId.ADAM_EPSILON)
    assert [f.severity for f in near] == [Severity.INFO]
    dead = findings(dyn(grad=5e-8, step_rms=(1.0, DEFAULT.adam_collapse / 4)), CheckId.ADAM_EPSILON)
    assert [f.severity for f in dead] == [Severity.WARN]
    assert dead[0].value == pytest.approx(1.0)  # every matrix collapsed: the whole model
    # a collapsed update whose gradient is large is Adam's noise floor, not eps
    assert not findings(dyn(grad=1e-3, step_rms=(1.0, 0.01)), CheckId.ADAM_EPSILON)


def test_adam_epsilon_collapsing_gradients_with_a_held_update_are_not_called_failing() -> None:
    """Gradients that fell ≥ 1000× to below eps: with Adam's recorded step held, info that
    says the gradient alone did not predict failure; with the step collapsed, the warning
    that names the collapse."""
    collapsing = (1e-3, 1e-5, 1e-7, 2e-8, 2e-8)

    def with_grads(d: Dynamics) -> Dynamics:
        return replace(d, updates=tuple(replace(u, grad_rms=collapsing) for u in d.updates))

    held = findings(with_grads(dyn(step_rms=(1.0, 0.8))), CheckId.ADAM_EPSILON)
    assert [f.severity for f in held] == [Severity.INFO]
    assert "did not predict failure" in held[0].message and "failed" not in held[0].message
    dead = findings(
        with_grads(dyn(step_rms=(1.0, DEFAULT.adam_collapse / 4))), CheckId.ADAM_EPSILON
    )
    assert [f.severity for f in dead] == [Severity.WARN]
    assert "collapsed over the steps" in dead[0].message and "not eps" in dead[0].hint


def test_update_size_reads_the_cumulative_movement() -> None:
    """Per-step ratios under the warn level, but the matrices moved past their initial
    norm in the steps (weights that grow with their updates): a warning; the same
    per-step ratios with a small cumulative movement stay quiet."""
    moved = findings(
        dyn(ratio=DEFAULT.update_ratio_warn / 2, drift=DEFAULT.update_drift_warn * 1.5),
        CheckId.UPDATE_SIZE,
    )
    assert [f.severity for f in moved] == [Severity.WARN]
    assert moved[0].value == pytest.approx(DEFAULT.update_drift_warn * 1.5)
    assert "initial norm" in moved[0].message
    assert not findings(
        dyn(ratio=DEFAULT.update_ratio_warn / 2, drift=DEFAULT.update_drift_warn / 2),
        CheckId.UPDATE_SIZE,
    )


def with_gains(d: Dynamics, drift: float, start: float = 1.0) -> Dynamics:
    """`d` plus a norm gain per block whose ‖g_t − g_0‖/‖g_0‖ reaches `drift` linearly
    (start 0: a Gemma-style 1 + w gain at w = 0, whose relative movement is undefined)."""
    gains = tuple(
        UpdateRecord(
            param=f"blocks.{b}.norm1.weight",
            block=b,
            role="norm",
            kind="norm-gain",
            ratio=(drift / STEPS,) * STEPS if start else (None,) * STEPS,
            grad_rms=(1e-3,) * STEPS,
            numel=64,
            drift=tuple(drift * t / STEPS if start else None for t in range(1, STEPS + 1)),
        )
        for b in range(N_BLOCKS)
    )
    return replace(d, updates=d.updates + gains)


def test_update_size_reads_the_norm_gains_movement() -> None:
    """Matrices under both matrix rules (a large init moves little relative to its norm),
    but the norm gains, which start at 1 in every init, moved past update-gain-drift-warn:
    a warning naming the gains; under it, with SGD (the rule is Adam's), or with gains
    that start at 0 (no relative movement to judge), quiet."""
    th = DEFAULT.update_gain_drift_warn
    quiet = dyn(ratio=DEFAULT.update_ratio_warn / 2, drift=DEFAULT.update_drift_warn / 4)
    moved = findings(with_gains(quiet, th * 2), CheckId.UPDATE_SIZE)
    assert [f.severity for f in moved] == [Severity.WARN]
    assert moved[0].value == pytest.approx(th * 2) and moved[0].threshold == th
    assert all(name.endswith("norm1.weight") for name in moved[0].layers)
    assert "norm gain" in moved[0].message and "learning rate" in moved[0].hint
    assert statistics(with_gains(quiet, th * 2)).gain_drift_median == pytest.approx(th * 2)
    assert not findings(with_gains(quiet, th / 2), CheckId.UPDATE_SIZE)
    assert not findings(with_gains(quiet, th * 2, start=0.0), CheckId.UPDATE_SIZE)
    sgd = dyn(ratio=0.05, drift=0.1, optimizer="sgd")
    assert not findings(with_gains(sgd, th * 2), CheckId.UPDATE_SIZE)
    # one warning per check: the matrices' own movement, when it fires, is the finding
    both = findings(
        with_gains(dyn(ratio=0.05, drift=DEFAULT.update_drift_warn * 2), th * 2),
        CheckId.UPDATE_SIZE,
    )
    assert len(both) == 1 and "median matrix" in both[0].message


def test_attn_scores_large_from_the_start_are_info_past_the_cap() -> None:
    """Scores large from the start (a std-0.2 init) that double past the cap are not the
    growth that precedes divergence: info, not an error."""
    cap = DEFAULT.attn_logit_cap
    f = findings(dyn(attn=(cap * 0.6, cap * 1.2)), CheckId.ATTN_LOGIT_GROWTH)
    assert [x.severity for x in f] == [Severity.INFO]
    assert "large from the start" in f[0].message


def test_adam_epsilon_small_share_is_info_and_collapse_is_named() -> None:
    d = dyn()
    one = "blocks.2.mlp.up.weight"
    collapsing = (1e-3, 1e-5, 1e-7, 2e-8, 2e-8)
    d = replace(
        d,
        updates=tuple(
            replace(u, grad_rms=collapsing, numel=4) if u.param == one else u for u in d.updates
        ),
    )
    f = findings(d, CheckId.ADAM_EPSILON)
    share = 4 / (4096 * (4 * N_BLOCKS - 1) + 4)
    assert [(x.severity, x.layers) for x in f] == [(Severity.INFO, (one,))]
    assert f[0].value == pytest.approx(share) and share < DEFAULT.adam_eps_share
    assert "collapsed over the steps" in f[0].message and "block 2" in f[0].message
    assert "not eps" in f[0].hint and "lower the learning rate" in f[0].hint


def test_adam_epsilon_ignores_gradients_that_are_zero_by_construction() -> None:
    """A bias on k gets ~1e-12 from step 0 (softmax is shift-invariant over keys)."""
    d = dyn()
    k_bias = UpdateRecord(
        param="blocks.0.attn.k_norm.bias",
        block=0,
        role="attn",
        kind="bias",
        ratio=(0.0,) * STEPS,
        grad_rms=(3e-12,) * STEPS,
        numel=10**6,
    )
    d = replace(d, updates=(*d.updates, k_bias))
    assert not findings(d, CheckId.ADAM_EPSILON)


def test_numbers_are_what_the_checks_judge() -> None:
    d = dyn(curve="post", ratio=0.2, attn=(0.2, 20.0), log_z=(4.85, 6.0), lr=1e-2)
    nums = numbers(d)
    assert nums["update_max"] == pytest.approx(0.2)
    assert nums["update_over_lr"] == pytest.approx(20.0)
    assert nums["amplification_sustain"] == pytest.approx(1.0)
    assert nums["attn_max"] == pytest.approx(20.0) and nums["attn_growth"] == pytest.approx(100)
    assert nums["log_z_drift"] == pytest.approx(1.15)
    assert statistics(d).steps == STEPS
