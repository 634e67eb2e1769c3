"""Train and scan the ground truth's grid, one JSON line per run (resumable).

    nice -n 10 python benchmarks/ground_truth/run_grid.py [--out data/runs.jsonl]
        [--limit N] [--no-scan] [--worker i/n]

Each line: the run (grid.Run.as_dict), its 300-step training (`grid.train`: loss curve,
validation loss, an independent record of the first 10 steps) and actscan's `--steps 10`
scan of the same configuration, init seed, batches, lr and warmup (`scan`: the Dynamics
record, floats to 4 significant digits, branch changes left out), so the checks can be
re-run offline with other thresholds (evaluate.py) without training or scanning again.
Runs already in --out are skipped, so an interrupted grid resumes. One CPU thread.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.ground_truth import grid
from benchmarks.ground_truth.evaluate import read_rows

DATA = Path(__file__).resolve().parent / "data" / "runs.jsonl"


def _round(x: Any) -> Any:
    if isinstance(x, float):
        return float(f"{x:.4g}") if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _round(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_round(v) for v in x]
    return x


def scan_run(run: grid.Run) -> dict[str, Any]:
    """actscan's scan with steps=10 at the run's lr and schedule: the Dynamics record."""
    from actscan import scan

    model = grid.build(run.config, run.seed)
    t0 = time.perf_counter()
    report = scan(
        model,
        inputs=lambda i: grid.train_batch(run.seed, i),
        steps=grid.SCAN_STEPS,
        lr=run.lr,
        optimizer="adamw",
        betas=grid.BETAS,
        eps=grid.EPS,
        weight_decay=0.0,
        warmup=run.warmup,
        seed=run.seed,
        batch=grid.BATCH,
        seq_len=grid.SEQ,
        amp="bf16" if run.config.precision == "bf16" else None,
        channels=False,
    )
    assert report.dynamics is not None
    dyn = dataclasses.asdict(report.dynamics)
    for step in dyn["steps"]:  # what the dynamics checks read; the rest left out (size)
        step["change"] = [
            {
                "name": c["name"],
                "kind": c["kind"],
                "k": c["k"],
                "block": c["block"],
                "rel": c["rel"],
            }
            for c in step["change"]
            if c["kind"] == "stream"
        ]
        del step["stream"], step["gain_drift"]
    return {
        "dynamics": _round(dyn),
        "findings": [
            [f.check, str(f.severity)]
            for f in report.findings
            if str(f.check).startswith(
                ("update-size", "amplification", "attn-logit-growth", "logit-drift", "adam-epsilon")
            )
        ],
        "arch": _round({k: v for k, v in report.model.arch.items() if k != "config"}),
        "family": report.model.family,
        "scan_s": round(time.perf_counter() - t0, 2),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DATA)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--no-scan", action="store_true")
    ap.add_argument("--worker", default="0/1", help="i/n: run every n-th lr curve from the i-th")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    i_w, n_w = (int(x) for x in args.worker.split("/"))
    # every run stored so far (data/runs.jsonl.gz and any runs*.jsonl) is done
    done = set(read_rows()) if args.out == DATA else set()
    if args.out.exists():
        done |= {json.loads(line)["key"] for line in args.out.read_text().splitlines() if line}
    if n_w > 1:  # each worker appends to its own file: runs.jsonl → runs.i.jsonl
        args.out = args.out.with_suffix(f".{i_w}.jsonl")
        if args.out.exists():
            done |= {json.loads(line)["key"] for line in args.out.read_text().splitlines() if line}
    mine = {
        key
        for j, key in enumerate(dict.fromkeys(r.curve_key for r in grid.runs()))
        if j % n_w == i_w
    }
    todo = [r for r in grid.runs() if r.key not in done and r.curve_key in mine][: args.limit]
    print(f"{len(done)} done, {len(todo)} to run → {args.out}", flush=True)
    t0 = time.perf_counter()
    for i, run in enumerate(todo):
        t1 = time.perf_counter()
        row: dict[str, Any] = {"key": run.key, "curve": run.curve_key, **run.as_dict()}
        row["half"] = run.config.half()
        row["train"] = grid.train(run)
        row["train_s"] = round(time.perf_counter() - t1, 2)
        if not args.no_scan:
            row["scan"] = scan_run(run)
        with args.out.open("a") as fh:
            fh.write(json.dumps(row) + "\n")
        print(
            f"[{i + 1}/{len(todo)} {time.perf_counter() - t0:.0f}s] {run.key} "
            f"val {row['train']['val']} ({time.perf_counter() - t1:.1f}s)",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
