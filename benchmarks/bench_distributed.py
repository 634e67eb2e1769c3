"""Distributed runs: the merge's cost and each rank's parameter memory, world sizes 1 and 2.

For each world size W it runs `actscan profile CONFIG --nproc W` (gloo on CPU unless
--device cuda) with ACTSCAN_DIST_STATS set, and reads every rank's figures: the merge's
wall time (collectives + Chan's merge, the one recorder), this rank's shards, its build
peak and its run peak parameter bytes, against the whole model's bytes (what a
one-process run holds). The default model is a built-in config whose blocks hold most of
the weights (24 layers × d 128), where the expected peak is total / W plus about a block.

With `--steps N` (default 3; 0 skips it) each world size also runs `--steps N` (the
sharded optimizer, `actscan/distributed/steps.py`): the wall time it adds per step, and
the largest relative gap of its `dynamics` figures to the first world size's.

    python benchmarks/bench_distributed.py [--layers 24] [--width 128] [--worlds 1,2]
                                           [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIG = """family: actscan-gpt
n_layers: {layers}
d_model: {width}
n_heads: 4
vocab_size: 256
seq_len: 64
norm: layernorm
placement: pre
activation: gelu
branch_scale: depth
init: gpt2
"""


def run(
    world: int, cfg: Path, tmp: Path, device: str, batch: int, steps: int = 0
) -> dict[str, object]:
    prefix = tmp / f"w{world}"
    env = dict(os.environ, ACTSCAN_DIST_STATS=str(prefix))
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world)))
    out = tmp / f"w{world}.json"
    cmd = [
        sys.executable,
        "-m",
        "actscan",
        "profile",
        str(cfg),
        "--nproc",
        str(world),
        "--batch",
        str(batch),
        "--device",
        device,
        "--json",
        str(out),
        "-q",
    ]
    if steps:
        out = tmp / f"w{world}.steps.json"
        cmd[-3:-1] = ["--json", str(out), "--steps", str(steps)]
    start = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    wall = time.perf_counter() - start
    if res.returncode not in (0, 1):
        sys.exit(f"world {world} failed ({res.returncode}): {res.stderr.strip()}")
    ranks = [json.loads((tmp / f"w{world}.rank{r}.json").read_text()) for r in range(world)]
    whole = int(ranks[0]["total_param_bytes"])
    peak = max(max(int(r["build_peak_bytes"]), int(r["run_peak_bytes"])) for r in ranks)
    merge = max(max(r["merge_ms"]) for r in ranks)
    return {
        "world": world,
        "wall_s": wall,
        "merge_ms": merge,
        "whole_MB": whole / 2**20,
        "dynamics": json.loads(out.read_text()).get("dynamics"),
        "loop_ms": max(float(r.get("steps_loop_ms", 0.0)) for r in ranks),
        "reduce_ms": max(max(r.get("steps_reduce_ms") or [0.0]) for r in ranks),
        "local_MB": max(int(r["local_param_bytes"]) for r in ranks) / 2**20,
        "peak_MB": peak / 2**20,
        "peak_over_whole": peak / whole,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--worlds", default="1,2")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        cfg = tmp / "model.yaml"
        cfg.write_text(CONFIG.format(layers=args.layers, width=args.width))
        rows = [run(w, cfg, tmp, args.device, args.batch) for w in worlds]
        stepped = [run(w, cfg, tmp, args.device, args.batch, args.steps) for w in worlds]
    print(f"model: {args.layers} layers × d {args.width}, batch {args.batch}, {args.device}")
    print(
        "| world | merge ms | whole model MB | shards MB / rank | peak MB / rank | peak ÷ whole "
        "| wall s |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        cells = [
            r["world"],
            f"{r['merge_ms']:.1f}",
            f"{r['whole_MB']:.2f}",
            f"{r['local_MB']:.2f}",
            f"{r['peak_MB']:.2f}",
            f"{r['peak_over_whole']:.2f}",
            f"{r['wall_s']:.1f}",
        ]
        print("| " + " | ".join(str(c) for c in cells) + " |")
    if not args.steps:
        return
    print(f"\n--steps {args.steps} (adamw, lr 1e-3):")
    print(
        f"| world | wall s | step loop ms / step | all-reduces ms / step (max) "
        f"| dynamics gap to world {worlds[0]} |"
    )
    print("| --- | --- | --- | --- | --- |")
    for st in stepped:
        per = float(st["loop_ms"]) / args.steps  # type: ignore[arg-type]
        gap = largest_gap(stepped[0]["dynamics"], st["dynamics"])
        print(
            f"| {st['world']} | {st['wall_s']:.1f} | {per:.0f} | {st['reduce_ms']:.1f} "
            f"| {gap:.1e} |"
        )


def largest_gap(a: object, b: object) -> float:
    """The largest relative difference between the floats of two equal-shaped documents."""
    if isinstance(a, dict) and isinstance(b, dict):
        return max([largest_gap(a[k], b[k]) for k in a], default=0.0)
    if isinstance(a, list) and isinstance(b, list):
        return max([largest_gap(x, y) for x, y in zip(a, b, strict=True)], default=0.0)
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) / max(abs(a), abs(b), 1e-300)
    return 0.0


if __name__ == "__main__":
    main()
