"""What `--trace` costs: one traced batch ÷ one plain forward+backward of the same batch.

    python benchmarks/trace_cost.py [--layers 12] [--width 768] [--batch 4] [--seq 64]
                                    [--repeats 3] [--dtype fp32|fp16]

The built-in family at L × d. "plain": forward, next-token loss, autograd.grad of every
parameter (as the recorded pass runs it, no hooks). "trace": actscan.measure.trace's
trace_batch on the same batch: pass 1 (the dispatch mode's per-operation reductions,
forward and backward, one transfer) and, where an operation broke, pass 2 up to it. With
--dtype fp16 and --break, one MLP weight is scaled so that fp16 overflows in the last
block: pass 2 runs too (the worst case: up to the last block's operations). Interleaved,
median of --repeats after a warm-up; process CPU time alongside (steadier on a shared
machine). Prints one table and the trace record.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from actscan.measure.inputs import Batch
from actscan.measure.trace import TraceRun, trace_batch
from actscan.models.arch import ArchConfig
from actscan.models.gpt import build_model


def _lm_loss(out: Any, b: Batch) -> torch.Tensor:
    logits = out if isinstance(out, torch.Tensor) else out[0]
    ids = b.args[0]
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten()
    )


def _timed(fn: Callable[[], object]) -> tuple[float, float]:
    w, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w, time.process_time() - c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", choices=("fp32", "fp16"), default="fp32")
    ap.add_argument("--break", dest="broken", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dt = torch.float16 if a.dtype == "fp16" else torch.float32
    cfg = ArchConfig(n_layers=a.layers, d_model=a.width, n_heads=max(a.width // 64, 1))
    model = build_model(cfg).to(dt).train()
    if a.broken:
        with torch.no_grad():
            model.blocks[-1].mlp.up.weight.mul_(3e5 if dt == torch.float16 else 1e30)
    ids = torch.randint(0, cfg.vocab_size, (a.batch, a.seq), generator=torch.Generator())
    batch = Batch(args=(ids,))
    params = [p for p in model.parameters() if p.requires_grad]

    def plain() -> None:
        loss = _lm_loss(model(ids), batch)
        torch.autograd.grad(loss.float(), params, allow_unused=True)

    run = TraceRun(loss_of=_lm_loss, autocast=contextlib.nullcontext, precision=dt)
    record: list[Any] = []

    def traced() -> None:
        record[:] = [trace_batch(model, batch, run)]

    plain(), traced()  # warm-up (the dispatch mode imports torch._dynamo once)
    rows: dict[str, list[tuple[float, float]]] = {"plain": [], "trace": []}
    for _ in range(a.repeats):
        rows["plain"].append(_timed(plain))
        rows["trace"].append(_timed(traced))
    med = {
        k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v))
        for k, v in rows.items()
    }
    print(
        f"built-in {a.layers} × {a.width}, batch {a.batch} × {a.seq}, {a.dtype}, "
        f"{a.threads} thread(s), median of {a.repeats}"
    )
    print("| run | wall s | CPU s |\n| --- | ---: | ---: |")
    for k, (w, c) in med.items():
        print(f"| {k} | {w:.2f} | {c:.2f} |")
    print(
        f"| trace ÷ plain | {med['trace'][0] / med['plain'][0]:.2f}× | "
        f"{med['trace'][1] / med['plain'][1]:.2f}× |"
    )
    print(record[0])


if __name__ == "__main__":
    main()
