"""How far the 10-step signals can go: cross-validated inside the CALIBRATION half.

    python benchmarks/ground_truth/ceiling.py

The held-out half shows what the shipped thresholds predict. It cannot say whether
*other* thresholds or rules over the same recorded numbers could reach the targets
(precision and recall ≥ 0.9, no healthy best-lr run flagged) without fitting on it. This
script asks that question of the calibration half alone, by leave-one-configuration-out:
each of its configurations in turn is left out, a rule is fitted on the others and then
judges the one left out; the out-of-fold verdicts are scored together (Wilson 95 %
intervals). Two fitting procedures, both over `fit.py`'s numbers:

- *best-F1 per number*: one threshold per number a warning judges (median matrix drift,
  median gain drift, the grown attention score, log Z beyond the loss, the logit
  peak), each its best-F1 cut that flags no healthy best-lr run, placed at the
  geometric midpoint to the value below it (fit.py's rule), any of them flagging;
- *greedy*: rules added one at a time, each the (number, cut) that catches the most
  unstable runs while the rule set keeps precision ≥ 0.9 and flags no healthy best-lr
  run on the training folds, up to `--rules` of them, from every number fit.py prints.

It also prints the in-sample ceiling (the greedy rule fitted and scored on the whole
calibration half), which is an optimistic bound, not a prediction. The held-out half is
never read.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from anywhere

from benchmarks.ground_truth.evaluate import wilson
from benchmarks.ground_truth.fit import best_cut, calibration_table, midpoint, value

SHIPPED = (
    "drift_median",
    "gain_drift_median (norm gains ‖g_N−g_0‖/‖g_0‖)",
    "attn_grown (attn_last where grown ≥ ×10, as the check judges)",
    "log_z_excess (drift − loss learned)",
    "logit_peak (max logit − mean log Z, after step 0)",
)
Rule = tuple[str, float]


def _flags(r: dict[str, Any], rules: list[Rule]) -> bool:
    return any((v := value(r, n)) is not None and v >= cut for n, cut in rules)


def fit_shipped(runs: list[dict[str, Any]]) -> list[Rule]:
    rules = []
    for name in SHIPPED:
        got = best_cut(runs, name)
        if got is not None:
            rules.append((name, midpoint(runs, name, got[0])))
    return rules


def fit_greedy(runs: list[dict[str, Any]], names: list[str], n_rules: int) -> list[Rule]:
    rules: list[Rule] = []
    for _ in range(n_rules):
        best: tuple[int, int, Rule] | None = None
        for name in names:
            for cut in sorted({v for r in runs if (v := value(r, name)) is not None}):
                trial = [*rules, (name, cut)]
                pred = [_flags(r, trial) for r in runs]
                pairs = list(zip(pred, runs, strict=True))
                if any(p and r["is_best"] and not r["unstable"] for p, r in pairs):
                    continue
                tp = sum(p and r["unstable"] for p, r in pairs)
                fl = sum(pred)
                if not fl or tp / fl < 0.9:
                    continue
                if best is None or (tp, -fl) > (best[0], -best[1]):
                    best = (tp, fl, (name, midpoint(runs, name, cut)))
        if best is None or best[0] <= (score(runs, rules)[0] if rules else 0):
            break
        rules.append(best[2])
    return rules


def score(runs: list[dict[str, Any]], rules: list[Rule]) -> tuple[int, int, int]:
    pred = [_flags(r, rules) for r in runs]
    tp = sum(p and r["unstable"] for p, r in zip(pred, runs, strict=True))
    return tp, sum(pred), sum(r["unstable"] for r in runs)


def _line(label: str, tp: int, flagged: int, unstable: int, healthy_best: int) -> str:
    p, r = wilson(tp, flagged), wilson(tp, unstable)
    return (
        f"  {label:34s} precision {tp / flagged if flagged else math.nan:.2f}"
        f" [{p[0]:.2f}, {p[1]:.2f}] ({tp}/{flagged})  recall {tp / unstable:.2f}"
        f" [{r[0]:.2f}, {r[1]:.2f}] ({tp}/{unstable})  healthy best-lr flagged {healthy_best}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rules", type=int, default=2, help="greedy: at most this many rules")
    args = ap.parse_args(argv)
    runs = calibration_table()
    names = list(runs[0]["values"])
    configs = sorted({r["config"] for r in runs})
    n_u = sum(r["unstable"] for r in runs)
    print(f"calibration half: {len(runs)} runs, {len(configs)} configurations, {n_u} unstable")
    print("leave one configuration out (fit on the others, judge the one left out):")
    for label, fit in (
        ("best-F1 cut per number", fit_shipped),
        (f"greedy, ≤ {args.rules} rules at P ≥ 0.9", lambda rs: fit_greedy(rs, names, args.rules)),
    ):
        tp = fl = hb = 0
        chosen: dict[str, int] = {}
        for c in configs:
            train = [r for r in runs if r["config"] != c]
            rules = fit(train)
            for n, _ in rules:
                chosen[n.split()[0]] = chosen.get(n.split()[0], 0) + 1
            for r in (r for r in runs if r["config"] == c):
                f = _flags(r, rules)
                tp += f and r["unstable"]
                fl += f
                hb += f and r["is_best"] and not r["unstable"]
        print(_line(label, tp, fl, n_u, hb))
        picks = ", ".join(f"{k} {v}" for k, v in chosen.items())
        print(f"  {'':34s} numbers chosen (folds): {picks}")
    rules = fit_greedy(runs, names, args.rules)
    tp, fl, _ = score(runs, rules)
    print("in sample (fitted and scored on the whole calibration half; a bound, not a claim):")
    rule = " or ".join(f"{n.split()[0]} ≥ {c:.4g}" for n, c in rules)
    print(_line(f"greedy: {rule}", tp, fl, n_u, 0))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
