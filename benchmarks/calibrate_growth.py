"""Calibration of the step-0 growth checks on the inits real families ship.

    nice -n 10 python benchmarks/calibrate_growth.py [--quick]

Builds transformers' Llama, Mistral, Qwen2, GPT-2 and Gemma from config objects with
their own `_init_weights` (offline, no weights), at their real depths 12–48 and narrow
widths (64–256; one 1024-wide point per family at 12 layers), and reads the residual
stream actscan measures at step 0 (forward only, the default 4 × 64 random tokens):

- drift: RMS of the last block's output ÷ block 0's output (what sqrt-growth grades);
- drift/√L: the same per √(blocks): pure √k accumulation of unit branches stays ≤ 1;
- jump: block 0's output ÷ the embedding (the step inside block 0);
- p: the fitted exponent of RMS ∝ k^p; γ: the fitted per-block gain;
- the severity sqrt-growth / exp-growth give with the thresholds of this checkout.

Planted rows (the pathologies the checks must keep naming): every weight at std 1 (the
stream jumps inside block 0), GPT-2 without its 1/√(2L) c_proj scaling, and the
per-block ×1.2 writes of exp-growth. Results go to benchmarks/results/growth-calibration.json
(small, kept in the repository); the table in docs/checks.md (sqrt-growth) is printed.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import torch

from actscan.records import CheckId
from actscan.run import scan

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "growth-calibration.json"
FAMILIES = ("llama", "mistral", "qwen2", "gpt2", "gemma")
DEPTHS = (12, 24, 32, 48)
WIDTHS = (64, 128, 256)
GROWTH = (CheckId.SQRT_GROWTH, CheckId.EXP_GROWTH)


def config(model_type: str, depth: int, width: int) -> Any:
    import transformers

    heads = max(2, width // 64)
    if model_type == "gpt2":
        kw: dict[str, Any] = dict(n_embd=width, n_layer=depth, n_head=heads, n_positions=128)
        kw.update(bos_token_id=0, eos_token_id=0)
    else:
        kw = dict(
            hidden_size=width,
            intermediate_size=4 * width,
            num_hidden_layers=depth,
            num_attention_heads=heads,
            num_key_value_heads=max(1, heads // 2),
            head_dim=width // heads,
            max_position_embeddings=128,
        )
    return transformers.AutoConfig.for_model(model_type, vocab_size=512, **kw)


def build(model_type: str, depth: int, width: int, seed: int) -> torch.nn.Module:
    import transformers

    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config(model_type, depth, width)).eval()


def measure(model: torch.nn.Module, seed: int) -> dict[str, Any]:
    report = scan(model, backward=False, seed=seed, channels=False, attention=False)
    pts = [p for p in report.stream if p.rms]
    blocks = [p for p in pts if p.block is not None]
    emb = next((p for p in pts if p.block is None), None)
    drift = blocks[-1].rms / blocks[0].rms  # type: ignore[operator]
    found = {f.check: f.severity.value for f in report.findings if f.check in GROWTH}
    return {
        "blocks": len(blocks),
        "embedding_rms": emb.rms if emb else None,
        "block0_rms": blocks[0].rms,
        "last_rms": blocks[-1].rms,
        "drift": drift,
        "drift_per_sqrt_L": drift / math.sqrt(len(blocks)),
        "jump": blocks[0].rms / emb.rms if emb and emb.rms else None,  # type: ignore[operator]
        "exponent": report.summary.get("growth_exponent"),
        "gain": report.summary.get("gain"),
        "findings": {str(k): v for k, v in found.items()},
    }


def post_ln(seed: int) -> dict[str, Any]:
    """The built-in 24-block post-LN GPT (0.02 init): its first LayerNorm steps a 0.028-RMS
    embedding up to 1, the largest healthy jump inside block 0 at hand."""
    from actscan.targets.resolve import resolve

    r = resolve("gpt-24-postln")
    return {"case": "built-in gpt-24-postln", "depth": 24, "width": None, **measure(r.model, seed)}


def planted(seed: int) -> list[dict[str, Any]]:
    rows = []
    model = build("llama", 12, 256, seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 1.0)
    rows.append(
        {"case": "llama, every weight std 1", "depth": 12, "width": 256, **measure(model, seed)}
    )
    model = build("gpt2", 48, 128, seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("c_proj.weight"):
                p.normal_(0.0, 0.02)
    rows.append(
        {"case": "gpt2 without 1/√(2L) c_proj", "depth": 48, "width": 128, **measure(model, seed)}
    )
    model = build("llama", 24, 128, seed)
    handles = []
    for i, layer in enumerate(model.model.layers):  # type: ignore[union-attr]
        for m in (layer.self_attn.o_proj, layer.mlp.down_proj):
            handles.append(m.register_forward_hook(lambda _m, _a, o, g=1.2**i: o * g))
    try:
        rows.append(
            {
                "case": "llama, block i's writes ×1.2^i",
                "depth": 24,
                "width": 128,
                **measure(model, seed),
            }
        )
    finally:
        for h in handles:
            h.remove()
    return rows


def main() -> None:
    torch.set_num_threads(1)
    quick = "--quick" in sys.argv
    grid = [(d, w) for d in DEPTHS for w in WIDTHS] + [(12, 1024)]
    seeds = (0,) if quick else (0, 1)
    rows = []
    for family in FAMILIES:
        for depth, width in grid if not quick else [(12, 128), (48, 128)]:
            for seed in seeds if width <= 256 else (0,):
                r = {"family": family, "depth": depth, "width": width, "seed": seed}
                r.update(measure(build(family, depth, width, seed), seed))
                rows.append(r)
                print(
                    f"{family:8} L={depth:2} d={width:4} s={seed} drift ×{r['drift']:.2f} "
                    f"(/√L {r['drift_per_sqrt_L']:.2f}) jump ×{r['jump']:.1f} "
                    f"p={r['exponent']:.2f} {r['findings']}",
                    flush=True,
                )
    rows.append(post_ln(0))
    print(f"post-LN: drift ×{rows[-1]['drift']:.2f} jump ×{rows[-1]['jump']:.1f}")
    plants = planted(0)
    for r in plants:
        print(
            f"planted: {r['case']}: drift ×{r['drift']:.2f} jump ×{r['jump']:.1f} {r['findings']}"
        )
    data = {
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "healthy": rows,
        "planted": plants,
    }
    if not quick:
        OUT.parent.mkdir(exist_ok=True)
        OUT.write_text(json.dumps(data, indent=1) + "\n")
    print(table(rows))


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: per family and depth, the largest drift, drift/√L and jump over widths/seeds."""
    lines = ["| family | L | drift (max over d, seeds) | drift/√L | jump in block 0 | p |"]
    lines.append("|---|---|---|---|---|---|")
    for family in FAMILIES:
        for depth in DEPTHS:
            sel = [r for r in rows if r.get("family") == family and r["depth"] == depth]
            if not sel:
                continue
            lines.append(
                f"| {family} | {depth} | ×{max(r['drift'] for r in sel):.2f} | "
                f"{max(r['drift_per_sqrt_L'] for r in sel):.2f} | "
                f"×{max(r['jump'] for r in sel):.1f} | {max(r['exponent'] for r in sel):.2f} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
