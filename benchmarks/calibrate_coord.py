"""Calibrate `coord-check`: the coordinate check's slopes for SP and μP, through the CLI.

Runs `actscan sweep CONFIG --width W --steps N --lr LR --set parametrization=P --json -`
for each parametrization and learning rate, and prints, per module group and step t, the
log–log slope of the group's mean |x_t| (and of mean |x_t − x_0| for t ≥ 1) against
width, then the extreme module slopes and the findings. SP under Adam must be flagged at
the readout and the last blocks; μP must be flat (no finding). The table in
docs/checks.md#coord-check comes from this script:

    .venv/bin/python benchmarks/calibrate_coord.py                  # widths 64..512
    .venv/bin/python benchmarks/calibrate_coord.py --widths 32,64,128 --lrs 1e-2

Slow-ish (a few seconds per sweep on 1 CPU core): kept out of the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

GROUPS = ("embedding", "early", "mid", "late", "head")


def sweep(args: argparse.Namespace, param: str, lr: float) -> dict[str, Any]:
    cmd = [
        sys.executable, "-m", "actscan", "sweep", args.config, "--width", args.widths,
        "--steps", str(args.steps), "--lr", str(lr), "--set", f"parametrization={param}",
        "--set", f"n_layers={args.depth}", "--set", f"seq_len={args.seq_len}",
        "--batch", str(args.batch), "--seq-len", str(args.seq_len), "--seed", str(args.seed),
        "--device", "cpu", "--fail-on", "never", "--json", "-", "--quiet",
    ]  # fmt: skip
    for s in args.set or []:
        cmd += ["--set", s]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if out.returncode not in (0, 1):
        sys.exit(f"{' '.join(cmd)}\n{out.stderr}")
    return json.loads(out.stdout)


def extremes(coord: dict[str, Any], t: int) -> tuple[float, float, float | None]:
    """(min, max) over non-head modules of both slopes at t, and the head's worst."""
    vals, head = [], []
    for s in coord["slopes"]:
        if s["t"] != t:
            continue
        pair = [v for v in (s["abs_slope"], s["delta_slope"]) if isinstance(v, float)]
        (head if s["kind"] == "head" else vals).extend(pair)
    worst_head = max(head, key=abs) if head else None
    return min(vals), max(vals), worst_head


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="gpt-12-preln")
    ap.add_argument("--widths", default="64,128,256,512")
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lrs", default="1e-3,3e-3,1e-2")
    ap.add_argument("--params", default="sp,mup")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", action="append", help="extra --set for every sweep")
    args = ap.parse_args()
    print(
        f"config {args.config}, depth {args.depth}, widths {args.widths}, steps {args.steps}, "
        f"batch {args.batch}×{args.seq_len}, AdamW"
    )
    print("group slopes per t: |x| / Δ (fit of the group's geometric-mean line)\n")
    for lr in (float(x) for x in args.lrs.split(",")):
        for param in args.params.split(","):
            start = time.perf_counter()
            doc = sweep(args, param, lr)
            took = time.perf_counter() - start
            coord = doc["coord"]
            steps = sorted({c["t"] for c in coord["curves"]})
            cells = {(c["group"], c["t"]): c for c in coord["curves"]}
            print(f"{param} lr {lr:g}  ({took:.0f} s)")
            for g in GROUPS:
                row = []
                for t in steps:
                    c = cells.get((g, t))
                    if c is None:
                        row.append("—")
                        continue
                    a, d = c["abs_slope"], c["delta_slope"]
                    cell = f"{a:+.2f}" if a is not None else "—"
                    cell += f"/{d:+.2f}" if d is not None else ""
                    row.append(("*" if c["beyond"] else " ") + cell)
                print(
                    f"  {g:<9} "
                    + "  ".join(f"t{t}:{x:<12}" for t, x in zip(steps, row, strict=True))
                )
            for t in steps:
                lo, hi, head = extremes(coord, t)
                h = f"{head:+.2f}" if head is not None else "—"
                print(f"  t{t} modules: slopes in [{lo:+.2f}, {hi:+.2f}], head worst {h}")
            verdict = [f"{f['severity']}: {', '.join(f['layers'][:6])}" for f in coord["findings"]]
            print("  findings: " + ("; ".join(verdict) if verdict else "none") + "\n")


if __name__ == "__main__":
    main()
