"""μP against the reference: the built-in `parametrization: mup` next to Microsoft's `mup`.

The same architecture (the built-in `gpt-12-preln` decoder at a given depth and width)
parametrized twice:

  builtin  `ActscanGPT` under `parametrization: mup` (actscan/models/gpt.py: ScaledReadout,
           the 1/d_head attention scale, hidden std ×1/√width_mult, per-group Adam rates
           from `actscan_param_groups`);
  mup      the same modules built in SP, then parametrized by the `mup` package alone: a
           `MuSharedReadout` head (the family ties the readout to the embedding),
           `set_base_shapes(model, base, delta=...)`, every weight drawn again by
           `mup.init.normal_` from the SP std (which divides a matrix's std by
           √width_mult itself), attention scale attn_mult/d_head as mup's README writes
           it (attn_mult = √d_head at the base: SP there), and `MuAdamW`'s groups.

Both are trained on one fixed batch of random tokens with AdamW (betas 0.9/0.95, eps
1e-8, as `--steps`) and measured by hooks written here, not actscan's recorder: at every
t = 0..N, the RMS and mean |x| of each block's attention and MLP outputs and block
output, the stream entering block 0 and the logits, and the same of x_t − x_0. Module
groups are the coordinate check's (embedding, early/mid/late thirds of the stack, head);
a group's value per width is the geometric mean of its modules', and its slope is the
least-squares slope of log value against log width. Unless `--no-check`, it also runs actscan's own
coordinate check (`actscan.scan(model, steps=N)` per width, then
`actscan.diagnose.coord.coord_check`) on both μP implementations and on SP.

    .venv/bin/python benchmarks/mup_reference.py                       # the docs' table
    .venv/bin/python benchmarks/mup_reference.py --depths 4 --lrs 1e-2 --seeds 0,1 --no-check

The table in docs/checks.md, "μP against the reference" comes from the first
command. tests/test_mup_reference.py imports this file for its builders. `mup` is a test
dependency (the Makefile installs it with --no-deps); actscan never imports it.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from actscan.diagnose.coord import GROUPS, CoordCheck, block_group, coord_check
from actscan.diagnose.thresholds import DEFAULT
from actscan.models.arch import ArchConfig, apply_overrides, build_config, read_config_file
from actscan.models.gpt import ActscanGPT, build_model
from actscan.targets.classify import shipped_configs

CONFIG = "gpt-12-preln"
BASE_WIDTH = 64  # the built-in default mup_base_width: both implementations share it
BETAS = (0.9, 0.95)
EPS = 1e-8
IMPLS = ("builtin", "mup", "sp", "overdivided")


def arch(
    width: int, depth: int, parametrization: str, base: int = BASE_WIDTH, **kw: Any
) -> ArchConfig:
    """`gpt-12-preln` at this depth and width (heads kept: d_head grows with width)."""
    cfg = build_config(read_config_file(shipped_configs()[CONFIG]))
    over: dict[str, Any] = {"n_layers": depth, "d_model": width, **kw}
    if parametrization == "mup":
        over.update(parametrization="mup", mup_base_width=base)
    return apply_overrides(cfg, over)


# -- the reference: the same modules, parametrized by the mup package ---------------------------
class MupPackageGPT(ActscanGPT):
    """The SP build of the architecture with mup's readout, attention scale, base shapes,
    init and optimizer groups. The steps engine (and the harness below) read the
    optimizer's groups from `actscan_param_groups`: here MuAdamW's, each with its
    parameters and learning rate only (the optimizer built from them sets the rest)."""

    def actscan_param_groups(self, lr: float) -> list[dict[str, Any]]:
        from mup import MuAdamW

        groups = MuAdamW(self.parameters(), lr=lr).param_groups
        return [{"params": g["params"], "lr": g["lr"]} for g in groups]


class OverdividedGPT(MupPackageGPT):
    """A planted μP bug: the hidden matrices' Adam rate divided by width_mult twice (the
    mistake `coord-shrink` is there for: their updates vanish like 1/width)."""

    def actscan_param_groups(self, lr: float) -> list[dict[str, Any]]:
        groups = super().actscan_param_groups(lr)
        m = float(self.head.width_mult())  # type: ignore[operator]
        return [{**g, "lr": g["lr"] / m if g["lr"] < lr else g["lr"]} for g in groups]


def _shell(cfg: ArchConfig, base: int, cls: type[MupPackageGPT] = MupPackageGPT) -> MupPackageGPT:
    """The SP modules with mup's tied readout and 1/d attention; weights not yet μP."""
    from mup import MuSharedReadout

    model = cls(cfg, seed=0)
    model.head = MuSharedReadout(model.tok_emb.weight, bias=False)
    base_head_dim = cfg.head_dim * base / cfg.d_model
    for block in model.blocks:
        block.attn.scale = math.sqrt(base_head_dim) / cfg.head_dim  # attn_mult / d_head
    return model


def mup_model(
    width: int,
    depth: int,
    seed: int,
    base: int = BASE_WIDTH,
    cls: type[MupPackageGPT] = MupPackageGPT,
    **kw: Any,
) -> MupPackageGPT:
    """The architecture under the `mup` package's μP, drawn from torch's generator at `seed`.

    set_base_shapes against a base (width `base`) and a delta model (2·base) marks which
    dimensions grow; its rescaling of an SP readout is skipped (`rescale_params=False`)
    because every weight is drawn afresh here by mup's own init from the SP std."""
    import mup

    cfg = arch(width, depth, "sp", **kw)
    model = _shell(cfg, base, cls)
    base_m = _shell(arch(base, depth, "sp", **kw), base)
    delta_m = _shell(arch(2 * base, depth, "sp", **kw), base)
    mup.set_base_shapes(model, base_m, delta=delta_m, rescale_params=False)
    with torch.no_grad():
        torch.manual_seed(seed)  # mup.init draws from the global generator
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif "norm" in name:
                p.fill_(1.0)
            else:  # embeddings (vector-like: std kept) and hidden matrices (÷√width_mult)
                std = cfg.init_std
                if name.endswith(("attn.proj.weight", "mlp.down.weight")):
                    std *= cfg.depth_scale  # the config's 1/√(2L), part of the SP std
                mup.init.normal_(p, std=std)
    return model


def builtin_model(
    width: int, depth: int, seed: int, base: int = BASE_WIDTH, **kw: Any
) -> ActscanGPT:
    return build_model(arch(width, depth, "mup", base, **kw), seed)


def sp_model(width: int, depth: int, seed: int, base: int = BASE_WIDTH, **kw: Any) -> ActscanGPT:
    return build_model(arch(width, depth, "sp", **kw), seed)


def overdivided_model(
    width: int, depth: int, seed: int, base: int = BASE_WIDTH, **kw: Any
) -> MupPackageGPT:
    return mup_model(width, depth, seed, base, OverdividedGPT, **kw)


BUILDERS: dict[str, Callable[..., nn.Module]] = {
    "builtin": builtin_model,
    "mup": mup_model,
    "sp": sp_model,
    "overdivided": overdivided_model,
}


# -- measuring: hooks written here, independent of actscan's recorder ---------------------------
@dataclass(frozen=True)
class Coords:
    """Per t, per module: (rms, mean |x|, rms of x_t − x_0, mean |x_t − x_0|)."""

    names: tuple[str, ...]
    groups: tuple[str, ...]  # each module's group
    values: np.ndarray  # (t, module, 4)
    loss: tuple[float, ...]


def tokens(vocab: int, batch: int, seq: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(seed))


def measure(
    model: nn.Module,
    ids: torch.Tensor,
    lr: float,
    steps: int,
    betas: tuple[float, float] = BETAS,
) -> Coords:
    """Train on `ids` (fixed batch, next-token loss) for `steps` AdamW steps with the
    model's own groups and record every module's coordinates on that batch at t = 0..N
    (mup's `get_coord_data` records the same forwards, at its t = 1..N+1)."""
    blocks = list(model.blocks)  # type: ignore[arg-type]
    n = len(blocks)
    mods: list[tuple[str, str, nn.Module, bool]] = [("blocks.0.in", "embedding", blocks[0], True)]
    for i, b in enumerate(blocks):
        g = block_group(i, n)
        mods += [(f"blocks.{i}.attn", g, b.attn, False), (f"blocks.{i}.mlp", g, b.mlp, False)]
        mods.append((f"blocks.{i}", g, b, False))
    mods.append(("head", "head", model.head, False))  # type: ignore[arg-type]
    got: dict[int, torch.Tensor] = {}

    def keep(i: int) -> Callable[..., None]:
        def hook(_m: nn.Module, args: Any, out: Any = None) -> None:
            x = args[0] if out is None else out
            got[i] = x.detach().float().clone()

        return hook

    handles = []
    for i, (_, _, m, pre) in enumerate(mods):
        handles.append(
            m.register_forward_pre_hook(keep(i)) if pre else m.register_forward_hook(keep(i))
        )
    opt = torch.optim.AdamW(
        model.actscan_param_groups(lr), lr=lr, betas=betas, eps=EPS, weight_decay=0.0
    )  # type: ignore[operator]
    x_in, y = ids[:, :-1], ids[:, 1:]
    first: dict[int, torch.Tensor] = {}
    rows, losses = [], []
    try:
        for t in range(steps + 1):
            logits = model(x_in)
            loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
            losses.append(float(loss.detach()))
            row = []
            for i in range(len(mods)):
                x = got[i]
                first.setdefault(i, x)
                d = x - first[i]
                row.append(
                    [x.pow(2).mean().sqrt(), x.abs().mean(), d.pow(2).mean().sqrt(), d.abs().mean()]
                )
            rows.append(torch.tensor(row, dtype=torch.float64))
            if t < steps:
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
    finally:
        for h in handles:
            h.remove()
    return Coords(
        names=tuple(m[0] for m in mods),
        groups=tuple(m[1] for m in mods),
        values=torch.stack(rows).numpy(),
        loss=tuple(losses),
    )


def slope(widths: Sequence[int], values: Sequence[float]) -> float:
    """Least-squares slope of log value on log width."""
    return float(np.polyfit(np.log(widths), np.log(values), 1)[0])


def group_slopes(
    widths: Sequence[int], runs: Sequence[Coords], stat: int
) -> dict[tuple[str, int], float]:
    """(group, t) → slope of the group's geometric-mean line (stat: column of Coords.values;
    a Δ column at t = 0 is all zeros and is left out)."""
    out: dict[tuple[str, int], float] = {}
    first = runs[0]
    for t in range(first.values.shape[0]):
        if stat >= 2 and t == 0:
            continue
        for g in GROUPS:
            idx = [i for i, gg in enumerate(first.groups) if gg == g]
            if not idx:
                continue
            line = [math.exp(float(np.mean(np.log(r.values[t, idx, stat])))) for r in runs]
            out[(g, t)] = slope(widths, line)
    return out


@dataclass(frozen=True)
class RefSweep:
    """One width sweep of one implementation: what both measurements take."""

    impl: str  # a BUILDERS key
    widths: tuple[int, ...]
    depth: int
    seed: int
    lr: float
    steps: int = 3
    base: int = BASE_WIDTH
    batch: int = 4
    arch_kw: tuple[tuple[str, Any], ...] = ()  # extra config values (vocab_size, seq_len)

    def model(self, width: int) -> nn.Module:
        return BUILDERS[self.impl](width, self.depth, self.seed, self.base, **dict(self.arch_kw))


def coord_slopes(sw: RefSweep) -> dict[str, dict[tuple[str, int], float]]:
    """The sweep's group slopes by these hooks: {"rms", "l1", "d_rms", "d_l1"}."""
    runs = []
    for w in sw.widths:
        model = sw.model(w)
        cfg: ArchConfig = model.config  # type: ignore[assignment]
        ids = tokens(cfg.vocab_size, sw.batch, cfg.seq_len, sw.seed)
        runs.append(measure(model, ids, sw.lr, sw.steps))
    stats = ("rms", "l1", "d_rms", "d_l1")
    return {k: group_slopes(sw.widths, runs, i) for i, k in enumerate(stats)}


def actscan_check(sw: RefSweep) -> CoordCheck:
    """actscan's coordinate check of the sweep: `scan(steps=N)` per width (the sweep's
    batch, seed and lr; actscan's own probe and recorder), judged by `coord_check` as
    `actscan sweep` judges its rows."""
    from actscan import scan

    rows = []
    for w in sw.widths:
        report = scan(sw.model(w), steps=sw.steps, lr=sw.lr, seed=sw.seed, batch=sw.batch)
        rows.append((sw.impl, sw.depth, w, report))
    check = coord_check(rows, DEFAULT)
    assert check is not None
    return check


def verdict(check: CoordCheck) -> str:
    """quiet, or each finding as 'warn grows +1.54' / 'info shrinks -0.74'."""
    return (
        ", ".join(
            f"{f.severity.value} {'grows' if (f.value or 0) > 0 else 'shrinks'} {f.value:+.2f}"
            for f in check.findings
        )
        or "quiet"
    )


def _cell(runs: Sequence[dict[str, dict[tuple[str, int], float]]], stat: str, group: str) -> str:
    """Seed-mean slope at t = 0 | min…max over t ≥ 1 and seeds of the |x| and Δ slopes."""
    t0 = [r[stat][(group, 0)] for r in runs if (group, 0) in r[stat]]
    later = [
        v
        for r in runs
        for q in (stat, "d_" + stat)
        for (g, t), v in r[q].items()
        if g == group and t >= 1
    ]
    if not t0:
        return "—"
    return f"{np.mean(t0):+.2f} \\| {min(later):+.2f}…{max(later):+.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--widths", default="64,128,256")
    ap.add_argument("--depths", default="4,12")
    ap.add_argument("--lrs", default="1e-3,1e-2")
    ap.add_argument("--seeds", default="0,1,2,3")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--stat", default="rms", choices=("rms", "l1"))
    ap.add_argument("--no-check", action="store_true", help="skip actscan's coordinate check")
    args = ap.parse_args()
    torch.set_num_threads(1)
    widths = tuple(int(w) for w in args.widths.split(","))
    seeds = [int(s) for s in args.seeds.split(",")]
    print(
        f"{CONFIG}, widths {args.widths}, mup base width {BASE_WIDTH}, {args.steps} AdamW steps "
        f"(betas {BETAS}, eps {EPS:g}), batch 4×64 random tokens, seeds {args.seeds}, "
        f"torch threads 1\nslopes of the group's {args.stat}: seed mean at t = 0 | min…max over "
        "t ≥ 1 and seeds of |x| and Δ = x_t − x_0; max diff: the largest difference of the "
        "seed-mean slopes, builtin − mup, over groups, t and both statistics\n"
    )
    head = ["depth", "lr", "impl", *GROUPS, "max diff"]
    if not args.no_check:
        head.append("actscan coord-check per seed")
    print("| " + " | ".join(head) + " |\n|" + " --- |" * len(head))
    for depth in (int(d) for d in args.depths.split(",")):
        for lr in (float(x) for x in args.lrs.split(",")):
            start = time.perf_counter()
            sweeps = {
                impl: [RefSweep(impl, widths, depth, s, lr, args.steps) for s in seeds]
                for impl in IMPLS
            }
            runs = {impl: [coord_slopes(sw) for sw in sweeps[impl]] for impl in ("builtin", "mup")}
            means = {
                impl: {
                    (q, key): float(np.mean([r[q][key] for r in rs]))
                    for q in (args.stat, "d_" + args.stat)
                    for key in rs[0][q]
                }
                for impl, rs in runs.items()
            }
            diff = max(abs(means["builtin"][k] - means["mup"][k]) for k in means["builtin"])
            for impl in IMPLS:
                cells = (
                    [_cell(runs[impl], args.stat, g) for g in GROUPS]
                    if impl in runs
                    else [""] * len(GROUPS)
                )
                row = [str(depth), f"{lr:g}", impl, *cells, f"{diff:.2f}" if impl == "mup" else ""]
                if not args.no_check:
                    row.append(" / ".join(verdict(actscan_check(sw)) for sw in sweeps[impl]))
                print("| " + " | ".join(row) + " |", flush=True)
            print(f"<!-- depth {depth}, lr {lr:g}: {time.perf_counter() - start:.0f} s -->")


if __name__ == "__main__":
    main()
