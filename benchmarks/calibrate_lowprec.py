"""Does the low-precision check predict a loss gap? Short trainings in simulated low
precision against the same run with bf16 GEMMs.

    nice -n 10 python benchmarks/calibrate_lowprec.py [--steps 100] [--seeds 3]
        [--out benchmarks/results/calibrate-lowprec.json]

Grid: transformers Llama and GPT-2 (2 layers, d 64, 4 heads, byte vocabulary 256, seq 64,
batches of 8), × variants of init and learning rate (`VARIANTS`), × the GEMM precision
bf16 / fp8 / mxfp8 / nvfp4, × seeds (the init and the batch order; every format of a seed
sees the same init and batches, so its gap to bf16 is paired). Every nn.Linear (and
GPT-2's Conv1D addmm) runs fake-quantized forward and backward (`QLinear`: Q(X)·Q(W)ᵀ,
dX = Q(dY)·Q(W), dW = Q(dY)ᵀ·Q(X), with the casts of actscan.measure.casts; attention's
matmuls stay in high precision, as the FP8 recipes keep them). Text: the Python standard
library's own sources (via sysconfig), as bytes. AdamW (0.9, 0.95), --steps steps, one
thread.

Label: a format has a loss gap when its final loss (mean of the last 10 steps) exceeds the
same seed's bf16 run's by more than GAP nats on average over the seeds and by more than
twice the paired gaps' standard error (so one seed's noise cannot make a gap), or is not
finite where bf16 is. Prediction: `scan(model, formats=…)`
at init (the same weights, one batch of the same text) has a `low-precision` finding that
names that format. The table gives, per format, the runs, the gaps, the flagged and the
precision/recall.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sysconfig
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from actscan import scan
from actscan.diagnose.lowprec import _error_ratio, _excess_underflow
from actscan.diagnose.thresholds import DEFAULT
from actscan.measure.casts import FORMATS, Recipe, quantize

SEQ, BATCH, VOCAB = 64, 8, 256
GAP = 0.05  # nats
FORMAT_NAMES = ("fp8", "mxfp8", "nvfp4")
# name → (learning rate, what is done to the fresh model)
VARIANTS: dict[str, tuple[float, Callable[[Any], None]]] = {}


def _variant(name: str, lr: float) -> Callable[[Callable[[Any], None]], Callable[[Any], None]]:
    def add(fn: Callable[[Any], None]) -> Callable[[Any], None]:
        VARIANTS[name] = (lr, fn)
        return fn

    return add


@_variant("default", 1e-3)
def _default(model: Any) -> None:
    pass


@_variant("lr 1e-2", 1e-2)
def _high_lr(model: Any) -> None:
    pass


@_variant("embedding channel x1e4", 1e-3)
def _outlier(model: Any) -> None:
    with torch.no_grad():
        model.get_input_embeddings().weight[:, 5] *= 1e4


@_variant("embedding channel x1e2", 1e-3)
def _mild_outlier(model: Any) -> None:
    with torch.no_grad():
        model.get_input_embeddings().weight[:, 5] *= 1e2


@_variant("weights x1e-2", 1e-3)
def _small(model: Any) -> None:
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(1e-2)


@_variant("weights x1e-3", 1e-3)
def _tiny(model: Any) -> None:
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(1e-3)


def text_tokens() -> torch.Tensor:
    """Bytes of the standard library's sources (a fixed selection, in name order)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    data = b"".join(p.read_bytes() for p in sorted(stdlib.glob("*.py"))[:60])
    return torch.tensor(list(data), dtype=torch.long)


def batch(tokens: torch.Tensor, step: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(step + 1_000_003 * seed)
    starts = torch.randint(0, len(tokens) - SEQ - 1, (BATCH,), generator=gen)
    return torch.stack([tokens[s : s + SEQ] for s in starts.tolist()])


def build(family: str, seed: int = 0) -> Any:
    import transformers

    torch.manual_seed(seed)
    tr: Any = transformers  # the config classes take their attributes as **kwargs
    if family == "llama":
        cfg = tr.LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, attn_implementation="eager",
        )  # fmt: skip
        return tr.LlamaForCausalLM(cfg)
    cfg = tr.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, attn_implementation="eager",
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return tr.GPT2LMHeadModel(cfg)


def _q(t: torch.Tensor, recipe: Recipe | None, operand: str) -> torch.Tensor:
    """`t` cast along its last dimension (bf16 rounding when `recipe` is None)."""
    if recipe is None:
        return t.to(torch.bfloat16).to(t.dtype)
    return quantize(t.reshape(-1, t.shape[-1]), recipe, operand).reshape(t.shape).to(t.dtype)


class QLinear(torch.autograd.Function):
    """y = Q(x)·Q(w)ᵀ + b with the gradients of the quantized GEMMs."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: Any, recipe: Any) -> torch.Tensor:
        qx, qw = _q(x, recipe, "input"), _q(w, recipe, "weight")
        ctx.save_for_backward(qx, qw)
        ctx.recipe, ctx.bias = recipe, b is not None
        return F.linear(qx, qw, b)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        qx, qw = ctx.saved_tensors
        qg = _q(g, ctx.recipe, "grad")
        dx = qg @ qw
        dw = qg.reshape(-1, qg.shape[-1]).t() @ qx.reshape(-1, qx.shape[-1])
        db = g.reshape(-1, g.shape[-1]).sum(0) if ctx.bias else None
        return dx, dw, db, None


class FakeQuant(TorchFunctionMode):
    """Every linear (and addmm: GPT-2's Conv1D) through QLinear."""

    def __init__(self, recipe: Recipe | None) -> None:
        super().__init__()
        self.recipe = recipe

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "linear":
            x, w = args[0], args[1]
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            return QLinear.apply(x, w, b, self.recipe)
        if name == "addmm" and not kwargs and len(args) == 3:
            b, x, w = args
            return QLinear.apply(x, w.t(), b, self.recipe)
        return func(*args, **kwargs)


def train(
    family: str, variant: str, fmt: str | None, tokens: torch.Tensor, steps: int, seed: int = 0
) -> list[float]:
    lr, tweak = VARIANTS[variant]
    model = build(family, seed)
    tweak(model)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    recipe = FORMATS[fmt] if fmt else None
    losses = []
    for step in range(steps):
        ids = batch(tokens, step, seed)
        with FakeQuant(recipe):
            logits = model(ids).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            break
    return losses


def flagged(
    family: str, variant: str, tokens: torch.Tensor, seed: int = 0
) -> dict[str, str | None]:
    """Format → the low-precision finding's severity naming it at init (None: quiet)."""
    _, tweak = VARIANTS[variant]
    model = build(family, seed)
    tweak(model)
    report = scan(model, batch(tokens, 0, seed), formats=",".join(FORMAT_NAMES))
    th = DEFAULT
    out: dict[str, str | None] = dict.fromkeys(FORMAT_NAMES)
    for r in report.low_precision:  # the check's own two rules, per format
        if _excess_underflow(r) >= th.lowprec_underflow:
            out[r.format] = "warn"
        elif _error_ratio(r) >= th.lowprec_error_ratio and out[r.format] is None:
            out[r.format] = "info"
    return out


def final(losses: list[float]) -> float:
    tail = losses[-10:]
    return sum(tail) / len(tail) if len(tail) == 10 and all(map(math.isfinite, tail)) else math.inf


def label(base: Sequence[float], loss: Sequence[float]) -> tuple[bool, float, float]:
    """(gap?, mean paired gap, its standard error) over the seeds: non-finite where bf16
    is finite is a gap; otherwise the mean gap must pass GAP and twice its error."""
    pairs = [(b, x) for b, x in zip(base, loss, strict=True) if math.isfinite(b)]
    if not pairs:
        return False, math.nan, math.nan
    if any(not math.isfinite(x) for _, x in pairs):
        return True, math.inf, math.nan
    gaps = [x - b for b, x in pairs]
    mean = sum(gaps) / len(gaps)
    se = (
        math.sqrt(sum((g - mean) ** 2 for g in gaps) / (len(gaps) - 1) / len(gaps))
        if len(gaps) > 1
        else 0.0
    )
    return mean > GAP and mean > 2 * se, mean, se


def table(rows: Sequence[dict[str, Any]]) -> str:
    """Per format: runs, gaps, the check's warnings (and any finding), precision, recall."""
    out = [
        "| format | configurations | loss gap | warned | warned with a gap | precision "
        "| recall | any finding (warn or info) | with a gap |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for fmt in FORMAT_NAMES:
        rs = [r for r in rows if r["format"] == fmt]
        gaps = sum(r["label"] for r in rs)
        warned = sum(r["warned"] for r in rs)
        both = sum(r["label"] and r["warned"] for r in rs)
        anyf = sum(r["flagged"] for r in rs)
        anyb = sum(r["label"] and r["flagged"] for r in rs)
        p = f"{both / warned:.2f}" if warned else "–"
        rc = f"{both / gaps:.2f}" if gaps else "–"
        out.append(
            f"| {fmt} | {len(rs)} | {gaps} | {warned} | {both} | {p} | {rc} | {anyf} | {anyb} |"
        )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/calibrate-lowprec.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    tokens = text_tokens()
    seeds = range(args.seeds)
    rows = []
    for family in ("llama", "gpt2"):
        for variant in VARIANTS:
            t = time.perf_counter()
            base = [final(train(family, variant, None, tokens, args.steps, s)) for s in seeds]
            flags = [flagged(family, variant, tokens, s) for s in seeds]
            for fmt in FORMAT_NAMES:
                loss = [final(train(family, variant, fmt, tokens, args.steps, s)) for s in seeds]
                gap, mean, se = label(base, loss)
                sev = [f[fmt] for f in flags]
                rows.append(
                    {"family": family, "variant": variant, "format": fmt, "bf16": base,
                     "loss": loss, "gap": mean, "gap_se": se, "label": gap, "flags": sev,
                     "warned": sev.count("warn") * 2 > len(sev),
                     "flagged": sum(f is not None for f in sev) * 2 > len(sev)}
                )  # fmt: skip
                print(f"{family:6s} {variant:24s} {fmt:6s} bf16 {statistics.fmean(base):.3f} "
                      f"{fmt} {statistics.fmean(loss):.3f} gap {mean:+.3f} ± {se:.3f} "
                      f"label {gap} flags {sev}", flush=True)  # fmt: skip
            print(f"  ({time.perf_counter() - t:.0f} s)", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"steps": args.steps, "seeds": args.seeds, "gap": GAP, "rows": rows}, indent=1)
    )
    print()
    print(table(rows))


if __name__ == "__main__":
    main()
