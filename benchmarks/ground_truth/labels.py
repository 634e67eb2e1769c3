"""The ground truth's labels, from the training runs alone (fixed before any scan is read).

    python benchmarks/ground_truth/labels.py [--runs FILE] [--out data/labels.json]

Per lr curve (one configuration, warmup and seed across the lr grid), `best` is the
lowest validation loss any of its lrs reached after 300 steps, and `best_lr` that lr.
A run is **unstable** when

- *diverged*: a non-finite loss, or its final train loss (mean of the last 10 steps)
  above its first;
- *worse*: its lr is above `best_lr` and its validation loss is ≥ 0.5 nats above `best`
  (it failed to train at that lr, where a lower one trained);
- *spike*: a train loss ≥ 1 nat above the median of the 10 steps before it, after step 20
  (a loss spike; at any lr).

A run below `best_lr` that is merely slower is *slow*, not unstable: the step checks judge
whether an lr is too large. A curve is labelled only when all its lrs ran. The split is
by configuration (family × depth × width × init × precision), `grid.Config.half`, a seeded
hash: thresholds are fitted on "calibration" only.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from anywhere

HERE = Path(__file__).resolve().parent
LABELS = HERE / "data" / "labels.json"
WORSE_NATS = 0.5
SPIKE_NATS, SPIKE_WINDOW, SPIKE_AFTER = 1.0, 10, 20


def final_loss(losses: list[float | None]) -> float:
    if not losses or any(x is None or not math.isfinite(x) for x in losses):
        return math.nan
    return statistics.fmean(x for x in losses[-10:] if x is not None)


def spikes(losses: list[float | None]) -> int:
    vals = [x for x in losses if x is not None]
    return sum(
        1
        for t in range(max(SPIKE_WINDOW, SPIKE_AFTER), len(vals))
        if vals[t] - statistics.median(vals[t - SPIKE_WINDOW : t]) >= SPIKE_NATS
    )


def label_curve(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Labels of one lr curve's runs."""
    vals = [
        (r["train"]["val"], r["lr"])
        for r in runs
        if r["train"]["val"] is not None and math.isfinite(r["train"]["val"])
    ]
    best, best_lr = min(vals) if vals else (math.nan, math.inf)
    out = []
    for r in sorted(runs, key=lambda r: r["lr"]):
        losses = r["train"]["losses"]
        fin, first = final_loss(losses), (losses[0] if losses else None)
        val = r["train"]["val"]
        why = []
        if not math.isfinite(fin) or val is None or first is None or fin > first:
            why.append("diverged")
        elif r["lr"] > best_lr and val - best >= WORSE_NATS:
            why.append("worse")
        if spikes(losses):
            why.append("spike")
        slow = r["lr"] < best_lr and val is not None and val - best >= WORSE_NATS
        out.append(
            {
                "key": r["key"],
                "curve": r["curve"],
                "config": r["curve"].split("/")[0],
                "half": r["half"],
                "lr": r["lr"],
                "best_lr": best_lr,
                "best_val": best,
                "val": val,
                "first": first,
                "final": None if not math.isfinite(fin) else round(fin, 4),
                "unstable": bool(why),
                "why": "+".join(why) or ("slow" if slow else ""),
                "is_best": r["lr"] == best_lr,
            }
        )
    return out


def labels(rows: list[dict[str, Any]], n_lrs: int) -> list[dict[str, Any]]:
    by_curve: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_curve.setdefault(r["curve"], []).append(r)
    return [
        lab
        for curve in sorted(by_curve)
        if len(by_curve[curve]) == n_lrs
        for lab in label_curve(by_curve[curve])
    ]


def main(argv: list[str] | None = None) -> int:
    from benchmarks.ground_truth.evaluate import read_rows
    from benchmarks.ground_truth.grid import LRS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=Path, default=None, help="default: data/runs*.jsonl*")
    ap.add_argument("--out", type=Path, default=LABELS)
    args = ap.parse_args(argv)
    rows = [r for r in read_rows(args.runs).values() if r["lr"] in LRS]
    labs = labels(rows, len(LRS))
    args.out.write_text(json.dumps({"rules": __doc__, "runs": labs}, indent=0) + "\n")
    n_unstable = sum(r["unstable"] for r in labs)
    print(f"{len(labs)} runs labelled, {n_unstable} unstable → {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
