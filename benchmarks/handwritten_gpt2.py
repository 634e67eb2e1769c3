"""The baseline `actscan profile configs/gpt2-124m.yaml` is timed against: what one would
write by hand to build the same 124M-parameter model the usual PyTorch way (construct,
then the model's own init) and run one forward + backward on the same batch (4 × 64
random token ids, the profile defaults). stdlib + torch (+ the model class) only.
With `--steps N` (the baseline of `actscan profile … --steps N`): N AdamW steps (lr 1e-3,
betas (0.9, 0.95)) on fresh batches, then the final loss.

    python benchmarks/handwritten_gpt2.py [--device cpu|cuda] [--batch 4] [--seq-len 64]
                                          [--steps N]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F

from actscan.models.arch import ArchConfig
from actscan.models.gpt import ActscanGPT


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=0)
    args = ap.parse_args()
    # configs/gpt2-124m.yaml, written out by hand
    cfg = ArchConfig(
        n_layers=12,
        d_model=768,
        n_heads=12,
        vocab_size=50257,
        seq_len=1024,
        branch_scale="depth",
        init="gpt2",
    )
    torch.manual_seed(0)
    model = ActscanGPT(cfg).to(args.device)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len), device=args.device)
    logits = model(ids)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    if args.steps:  # step with the gradient above, then N − 1 more batches, then the loss
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
        for t in range(args.steps):
            opt.step()
            opt.zero_grad(set_to_none=True)
            ids = torch.randint(0, cfg.vocab_size, ids.shape, device=args.device)
            with torch.set_grad_enabled(t < args.steps - 1):
                logits = model(ids)
                loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
            if t < args.steps - 1:
                loss.backward()
    print(f"loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
