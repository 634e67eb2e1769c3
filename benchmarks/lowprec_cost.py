"""What `--formats fp8,mxfp8,nvfp4` costs: the low-precision watch on ÷ a plain
forward+backward, and where its time goes.

    python benchmarks/lowprec_cost.py [--batch 2] [--seq 128] [--reps 3] [--threads 1]

The model is configs/gpt2-124m.yaml (12 × 768, vocab 50257). "plain" is one forward,
next-token loss and backward (autograd.grad over the parameters); "watched" is the same
with actscan.measure.lowprec's watch entered as the recorded pass enters it (its module
hooks, the TorchFunctionMode around the forward, the output-gradient hooks) and its
records read once at the end (one transfer). Interleaved, median of --reps after a
warm-up, wall and process CPU time (steadier on a shared machine), and the median of each
round's ratio (the machine's drift over the run, ±20 % here, cancels within a round). A
third, untimed run splits the watch's own time by operand (each operand's casts, all
formats at once, timed around the call: exact on CPU, where nothing is asynchronous).
Results go to benchmarks/results/lowprec-cost-<timestamp>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from overhead import RESULTS, machine, time_once

FORMATS = ("fp8", "mxfp8", "nvfp4")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    import torch

    from actscan.measure import fused_casts, lowprec
    from actscan.measure.hooks import HookSet
    from actscan.measure.inputs import next_token_loss
    from actscan.models.arch import build_config, read_config_file
    from actscan.models.gpt import build_model

    torch.set_num_threads(args.threads)
    path = "configs/gpt2-124m.yaml"
    root = Path(__file__).resolve().parent.parent
    cfg = build_config(read_config_file(root / path), path)
    model = build_model(cfg, seed=0)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=gen)
    params = [p for p in model.parameters() if p.requires_grad]

    def plain() -> None:
        loss = next_token_loss(model(ids), ids)
        torch.autograd.grad(loss, params, allow_unused=True)

    def watched() -> None:
        with HookSet() as hooks, lowprec.lowprec_watch(model, FORMATS, True, hooks) as got:
            watch, forward = got
            with forward():
                out = model(ids)
            loss = next_token_loss(out, ids)
            torch.autograd.grad(loss, params, allow_unused=True)
            del out, loss
            watch.records()

    plain(), watched()  # warm-up
    samples: dict[str, list[float]] = {"plain": [], "watched": []}
    cpu: dict[str, list[float]] = {"plain": [], "watched": []}
    for _ in range(args.reps):
        for k, fn in (("plain", plain), ("watched", watched)):
            w, c = time_once(fn, "cpu")
            samples[k].append(w)
            cpu[k].append(c)
    med = {k: statistics.median(v) for k, v in samples.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    # each round's watched ÷ its own plain: the machine's drift over the run cancels
    pairs = zip(samples["watched"], samples["plain"], strict=True)
    paired = statistics.median(w / p for w, p in pairs)
    paired_cpu = statistics.median(w / p for w, p in zip(cpu["watched"], cpu["plain"], strict=True))

    # where the watch's time goes: each operand's casts timed, by operand kind
    split: dict[str, float] = defaultdict(float)
    cast = lowprec.operand_figures

    def timed(x: Any, recipes: Any, operand: str = "input", **kw: Any) -> Any:
        t = time.perf_counter()
        out = cast(x, recipes, operand, **kw)
        split[operand] += time.perf_counter() - t
        return out

    lowprec.operand_figures = timed  # type: ignore[assignment]
    try:
        t = time.perf_counter()
        watched()
        total = time.perf_counter() - t
    finally:
        lowprec.operand_figures = cast  # type: ignore[assignment]
    casts = sum(split.values())
    result = {
        "config": path,
        "batch": args.batch,
        "seq": args.seq,
        "threads": args.threads,
        "samples": samples,
        "median_s": med,
        "ratio": med["watched"] / med["plain"],
        "cpu_s": cpu,  # process CPU time: steadier than wall on a shared machine
        "cpu_ratio": med_cpu["watched"] / med_cpu["plain"],
        "paired_ratio": paired,
        "paired_cpu_ratio": paired_cpu,
        "split_s": dict(sorted(split.items(), key=lambda kv: -kv[1])),
        "casts_share_of_extra": casts / max(total - med["plain"], 1e-9),
        "compiled_casts": fused_casts.available(),  # numba (the `fast` extra) or torch's passes
        "load": os.getloadavg(),  # the 1/5/15-minute load at the end (a shared machine)
        "machine": machine("cpu"),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"lowprec-cost-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(result, indent=2))
    load = "/".join(f"{x:.1f}" for x in result["load"])
    how = "compiled (numba)" if result["compiled_casts"] else "torch passes (no numba)"
    print(f"12 x 768, batch {args.batch} x seq {args.seq}, {args.threads} thread(s), load {load}")
    print(f"casts: {how}")
    print(f"plain fwd+bwd     {med['plain']:.2f} s")
    print(f"--formats (3)     {med['watched']:.2f} s   ×{result['ratio']:.2f}  (target ≤ 1.5)")
    print(f"CPU time          ×{result['cpu_ratio']:.2f}")
    print(f"paired by round   ×{paired:.2f}  (CPU ×{paired_cpu:.2f}; median of the rounds' ratios)")
    print(f"casts: {casts:.2f} s of the {total - med['plain']:.2f} s extra; by operand:")
    for k, v in result["split_s"].items():
        print(f"  {k:14s} {v:.2f} s")
    print(f"-> {out.relative_to(root)}")


if __name__ == "__main__":
    main()
