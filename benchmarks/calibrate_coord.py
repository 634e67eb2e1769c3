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
        sys.executable,
        "-m",
        "actscan",
        "sweep",
        args.config,
        "--width",
        args.widths,
        "--steps",
        str(args.steps),
        "--lr",
        str(lr),
        "--set",
        f"parametrization={param}",
        "--seed",
        str(args.seed),
        "--device",
        "cpu",
        "--fail-on",
        "never",
        "--json",
        "-",
        "--quiet",
    ]
    if args.depth is not None:
        cmd += ["--set", f"n_layers={args.depth}"]
    if args.batch is not None:
        cmd += ["--batch", str(args.batch)]
    if args.seq_len is not None:
        cmd += ["--seq-len", str(args.seq_len)]
    for s in args.set or []:
        cmd += ["--set", s]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if out.returncode not in (0, 1):
        sys.exit(f"{' '.join(cmd)}\n{out.stderr}")
    return json.loads(out.stdout)


def extremes(items: list[dict[str, Any]], t: int) -> tuple[float, float]:
    """(min, max) of both slopes at t over non-head modules or groups."""
    vals = [
        v
        for s in items
        if s["t"] == t and s.get("kind", s.get("group")) != "head"
        for v in (s["abs_slope"], s["delta_slope"])
        if isinstance(v, float)
    ]
    return min(vals), max(vals)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="gpt-12-preln")
    ap.add_argument("--widths", default="64,128,256,512")
    ap.add_argument("--depth", type=int, default=None, help="default: the config's")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lrs", default="1e-3,3e-3,1e-2")
    ap.add_argument("--params", default="sp,mup")
    ap.add_argument("--batch", type=int, default=None, help="default: the sweep's (4)")
    ap.add_argument("--seq-len", type=int, default=None, help="default: the config's")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", action="append", help="extra --set for every sweep")
    args = ap.parse_args()
    print(
        f"config {args.config}, depth {args.depth or 'as configured'}, widths {args.widths}, "
        f"steps {args.steps}, batch {args.batch or 4}×{args.seq_len or 'config seq_len'}, AdamW"
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
                glo, ghi = extremes(coord["curves"], t)
                mlo, mhi = extremes(coord["slopes"], t)
                print(
                    f"  t{t} block groups in [{glo:+.2f}, {ghi:+.2f}], "
                    f"single modules in [{mlo:+.2f}, {mhi:+.2f}]"
                )
            verdict = [f"{f['severity']}: {', '.join(f['layers'][:6])}" for f in coord["findings"]]
            print("  findings: " + ("; ".join(verdict) if verdict else "none") + "\n")


if __name__ == "__main__":
    main()
