"""Fit the step checks' thresholds on the ground truth's CALIBRATION half only.

    python benchmarks/ground_truth/fit.py [--show]

For each number a step check judges (actscan.diagnose.steps.statistics), every cut
between two calibration runs' values is tried as "flag when ≥ cut"; printed per number:
the cut with the best F1 among those that flag no healthy best-lr run (the "no healthy
best-lr run flagged at warn" target; on a tie, the one with fewer false alarms), with its
precision and recall on the calibration half, and the geometric midpoint between it and
the largest value below it (where the shipped threshold goes, so that it does not sit on
a calibration run); and, where it differs, the lowest cut that flags no run that
trained, with the midpoint to the largest healthy value (the margin-keeping choice where
the best-F1 cut sits inside a cluster of runs at one lr: `update-gain-drift-warn`).
Candidates no check judges (`record_numbers`) are printed too. The held-out half is
never read here (evaluate.py reports it).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from anywhere

from benchmarks.ground_truth.evaluate import DATA, dynamics, read_rows

Number = Callable[[Any], float | None]


def numbers() -> dict[str, Number]:
    from actscan.diagnose.steps import ADAM_EPS_RATIO
    from actscan.diagnose.thresholds import Thresholds

    ATTN_GROWTH = Thresholds().attn_logit_growth

    def ratio_share(s: Any, below: float) -> float | None:
        return s.collapsed(below)[1] if s.grad_over_eps else None

    return {
        "update_max (per-step median ratio)": lambda s: s.update_max,
        "drift_max ‖W_N−W_0‖/‖W_0‖": lambda s: max(s.drift.values()) if s.drift else None,
        "drift_median": lambda s: s.drift_median,
        "gain_drift_median (norm gains ‖g_N−g_0‖/‖g_0‖)": lambda s: s.gain_drift_median,
        "attn_last": lambda s: s.attn_last,
        "attn_growth (last ÷ first)": lambda s: s.attn_growth,
        "attn_grown (attn_last where grown ≥ ×10, as the check judges)": lambda s: (
            s.attn_last if s.attn_growth is None or s.attn_growth >= ATTN_GROWTH else None
        ),
        "attn_layer_growth (max over layers)": lambda s: max(
            (b / a for a, b in s.attn_layers.values() if a > 0), default=None
        ),
        "log_z_drift": lambda s: s.log_z_drift,
        "log_z_excess (drift − loss learned)": lambda s: s.log_z_excess,
        "logit_peak (max logit − mean log Z, after step 0)": lambda s: s.logit_peak,
        "loss_rise (max loss_t − loss_0)": lambda s: (
            max((x - s.loss[0] for x in s.loss if x is not None and math.isfinite(x)), default=None)
            if s.loss and s.loss[0] is not None
            else None
        ),
        f"eps_low_share (grad ≤ {ADAM_EPS_RATIO:g} eps)": lambda s: (
            s.eps_low(ADAM_EPS_RATIO)[1] if s.grad_over_eps else None
        ),
        "collapse_share (≤ 0.1 of first step)": lambda s: ratio_share(s, 0.1),
        "collapse_share_any (update ≤ 0.1 of first, any grad)": lambda s: (
            (
                sum(s.numel.get(p, 0) for p, c in s.collapse.items() if c <= 0.1)
                / max(1, sum(s.numel.get(p, 0) for p in s.collapse))
            )
            if s.collapse
            else None
        ),
    }


def record_numbers() -> dict[str, Callable[[Any], float | None]]:
    """Candidates no check judges (yet), read from the Dynamics record itself: tried for
    update-size and logit-drift's recall (docs/calibration-dynamics.md, "Per check")."""
    from actscan.diagnose.steps import statistics

    def drift_q(d: Any, q: float) -> float | None:
        xs = sorted(statistics(d).drift.values())
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None

    def z_std(d: Any) -> list[float]:
        return [
            s.logits.log_z_std
            for s in d.steps
            if s.logits and s.logits.log_z_std is not None and math.isfinite(s.logits.log_z_std)
        ]

    return {
        "drift_q75 (matrices)": lambda d: drift_q(d, 0.75),
        "drift_q90 (matrices)": lambda d: drift_q(d, 0.9),
        "log_z_std_last": lambda d: z_std(d)[-1] if z_std(d) else None,
        "log_z_std_growth (last ÷ first)": lambda d: (
            z_std(d)[-1] / z_std(d)[0] if len(z_std(d)) > 1 and z_std(d)[0] > 0 else None
        ),
    }


def calibration_table() -> list[dict[str, Any]]:
    from actscan.diagnose.steps import statistics

    labels = json.loads((DATA / "labels.json").read_text())["runs"]
    rows = read_rows()
    out = []
    for lab in labels:
        if lab["half"] != "calibration":  # never fit on the held-out half
            continue
        row = rows.get(lab["key"])
        if row is None or "scan" not in row:
            continue
        d = dynamics(row)
        s = statistics(d)
        vals = {name: fn(s) for name, fn in numbers().items()}
        vals.update({name: fn(d) for name, fn in record_numbers().items()})
        out.append({**lab, "values": vals})
    return out


def value(r: dict[str, Any], name: str) -> float | None:
    """A run's number, None where it was not measured or is not finite."""
    v = r["values"][name]
    return v if v is not None and math.isfinite(v) else None


def below_cut(runs: list[dict[str, Any]], name: str, cut: float) -> float | None:
    """The largest value under `cut` among the runs."""
    return max((v for r in runs if (v := value(r, name)) is not None and v < cut), default=None)


def midpoint(runs: list[dict[str, Any]], name: str, cut: float) -> float:
    """Where a threshold goes: halfway (geometrically) between the cut and the value below
    it, so that it does not sit on a calibration run."""
    low = below_cut(runs, name, cut)
    return math.sqrt(cut * low) if low is not None and low > 0 and cut > 0 else cut


def best_cut(runs: list[dict[str, Any]], name: str) -> tuple[float, int, int, int, int] | None:
    vals = sorted({v for r in runs if (v := value(r, name)) is not None})
    best = None
    n_u = sum(r["unstable"] for r in runs)
    for cut in vals:
        pred = [(v := value(r, name)) is not None and v >= cut for r in runs]
        if any(p and r["is_best"] and not r["unstable"] for p, r in zip(pred, runs, strict=True)):
            continue
        tp = sum(p and r["unstable"] for p, r in zip(pred, runs, strict=True))
        fp = sum(pred) - tp
        f1 = 2 * tp / (2 * tp + fp + (n_u - tp)) if tp else 0.0
        # on a tie of F1, the cut with fewer false alarms (precision over recall)
        if best is None or (f1, -fp) > (best[0], -best[3]):
            best = (f1, cut, tp, fp, n_u - tp)
    return None if best is None else (best[1], best[2], best[3], best[4], n_u)


def clean_cut(runs: list[dict[str, Any]], name: str) -> tuple[float, float, int, int] | None:
    """The lowest cut that flags no run that trained (precision 1 on the calibration
    half): (the smallest unstable value above every healthy one, the largest healthy
    value, TP, unstable runs). Where the best-F1 cut falls inside a cluster of healthy
    and unstable runs at the same lr, this one keeps the whole gap as margin."""
    vals = [(v, r["unstable"]) for r in runs if (v := value(r, name)) is not None]
    healthy = max((v for v, u in vals if not u), default=None)
    above = sorted(v for v, u in vals if u and (healthy is None or v > healthy))
    if not above or healthy is None:
        return None
    return above[0], healthy, len(above), sum(u for _, u in vals)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--show", action="store_true", help="every run's values too")
    args = ap.parse_args(argv)
    runs = calibration_table()
    n_u = sum(r["unstable"] for r in runs)
    print(f"calibration half: {len(runs)} runs, {n_u} unstable")
    for name in (*numbers(), *record_numbers()):
        got = best_cut(runs, name)
        if got is None:
            print(f"  {name:55s} no cut")
            continue
        cut, tp, fp, fn, _ = got
        p = tp / (tp + fp) if tp + fp else math.nan
        low = below_cut(runs, name, cut)
        print(
            f"  {name:55s} ≥ {cut:<10.4g} P {p:.2f} R {tp / n_u if n_u else math.nan:.2f}"
            f" (TP {tp} FP {fp} FN {fn}); below it {low if low is not None else math.nan:.3g},"
            f" midpoint {midpoint(runs, name, cut):.3g}"
        )
        clean = clean_cut(runs, name)
        if clean is not None and clean[0] != cut:
            c, h, tp_c, n_c = clean
            print(
                f"  {'':55s}   no false alarm: ≥ {c:<8.4g} R {tp_c / n_c:.2f} (TP {tp_c});"
                f" largest healthy {h:.3g}, midpoint {math.sqrt(c * h) if c > 0 < h else c:.3g}"
            )
    if args.show:
        for r in sorted(runs, key=lambda r: r["key"]):
            v = " ".join(f"{x:.3g}" if x is not None else "–" for x in r["values"].values())
            print(f"{r['key']:45s} {'U' if r['unstable'] else '.'} {r['why']:10s} {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
