"""Ground truth for the dynamics checks: do they predict which tiny runs fail to train?

    python benchmarks/calibrate_dynamics.py [--quick] [--phase train|scan|report|all]
        [--cache PREFIX] [--steps 150] [--sets memorise:0,memorise:1,markov:0]
        [--deep-steps 100] [--deep-sets memorise:0] [--out docs/calibration-dynamics.md]

Two phases, both resumable (every finished run is one line of the cache, keyed by its
grid cell, so an interrupted grid picks up where it stopped):

  train  trains each grid cell for --steps (--deep-steps) AdamW steps (betas 0.9/0.95,
         eps 1e-8, no weight decay, no warmup) on CPU, one thread; records the loss curve.
  scan   runs `scan(model, steps=10, lr=lr)` (the same config, init seed, task batches
         and learning rate) and stores its whole Dynamics record.
  report re-runs the dynamics checks on the stored records with the current thresholds,
         joins them to the labels and writes the Markdown tables with precision/recall per
         check (between the markers of --out: docs/calibration-dynamics.md).

Grid: placement pre/post × depth 6/24 × branch scale none/depth × qk_norm off/on ×
lr 1e-3/3e-3/1e-2/3e-2, for each task:seed of --sets (depth 6, --steps) and --deep-sets
(depth 24, --deep-steps: trimmed so the grid fits ~30 min on a shared 2-core machine).
Models: actscan-gpt, d_model 64, 4 heads, vocab 128, seq 32, GPT-2 init, batches of 8.
`--quick` trains 4 cells (2-layer, 60 steps) to check the pipeline end to end in seconds.

Tasks (structured, so a run that trains reaches a loss far below ln V):
  memorise  16 fixed random sequences, each batch 8 of them drawn at random: a model that
            trains memorises them (loss → ~0).
  markov    a first-order chain where each token has 4 possible successors, drawn
            uniformly: the best loss is ln 4 ≈ 1.39 after the first token.

Labels (see `label`): a run is *unstable* when its loss went NaN, when its final loss (mean
of the last 10 steps) is above its first, or when it failed to train at a learning rate
above the best one of its configuration: final loss − best final ≥ half of (first loss −
best final). Runs at a learning rate below the best one that are merely slower are not
unstable. A spike ≥ ×2 the running median is recorded too but only counts when the
jump is also ≥ 1 nat: runs that memorise down to ~0.1 wobble by large ratios of nothing.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from actscan.models.arch import ArchConfig
from actscan.models.gpt import AttentionLogits, build_model

ROOT = Path(__file__).resolve().parent.parent
VOCAB, SEQ, D_MODEL, HEADS, BATCH = 128, 32, 64, 4, 8
LRS = (1e-3, 3e-3, 1e-2, 3e-2)
SCAN_STEPS = 10


@dataclass(frozen=True)
class Cell:
    """One grid cell: a configuration, a learning rate, a task and a seed."""

    placement: str
    layers: int
    branch: str
    qk: bool
    lr: float
    task: str
    seed: int

    @property
    def key(self) -> str:
        return (
            f"{self.task}/s{self.seed}/{self.placement}-{self.layers}-{self.branch}"
            f"-{'qk' if self.qk else 'noqk'}/lr{self.lr:g}"
        )

    @property
    def config_key(self) -> str:
        """The cell without its learning rate: labels compare runs across the lr grid."""
        return self.key.rsplit("/", 1)[0]

    def arch(self) -> ArchConfig:
        return ArchConfig(
            n_layers=self.layers,
            d_model=D_MODEL,
            n_heads=HEADS,
            vocab_size=VOCAB,
            seq_len=SEQ,
            placement=self.placement,
            branch_scale=self.branch,
            qk_norm=self.qk,
            init="gpt2",
        )


def grid(
    sets: list[tuple[str, int]], quick: bool, deep_sets: list[tuple[str, int]] | None = None
) -> list[Cell]:
    if quick:
        return [
            Cell("post", 2, "none", qk, lr, "memorise", 0)
            for qk, lr in itertools.product((False, True), (1e-3, 3e-2))
        ]
    cells = [
        Cell(p, n, b, qk, lr, task, seed)
        for n in (6, 24)
        for (task, seed), p, b, qk, lr in itertools.product(
            sets if n == 6 or deep_sets is None else deep_sets,
            ("pre", "post"),
            ("none", "depth"),
            (False, True),
            LRS,
        )
    ]
    # cheapest first, so a trimmed run still covers every configuration at depth 6
    return sorted(cells, key=lambda c: (c.layers, c.seed, c.task))


def task_batches(task: str, seed: int) -> Callable[[int], torch.Tensor]:
    """batch index → token ids (BATCH, SEQ); deterministic in (task, seed, index)."""
    gen = torch.Generator().manual_seed(10_000 + seed)
    if task == "memorise":
        data = torch.randint(VOCAB, (16, SEQ), generator=gen)

        def memorise(i: int) -> torch.Tensor:
            g = torch.Generator().manual_seed(seed * 1_000_003 + i)
            return data[torch.randint(len(data), (BATCH,), generator=g)]

        return memorise
    if task == "markov":
        succ = torch.randint(VOCAB, (VOCAB, 4), generator=gen)

        def markov(i: int) -> torch.Tensor:
            g = torch.Generator().manual_seed(seed * 1_000_003 + i)
            ids = torch.empty(BATCH, SEQ, dtype=torch.long)
            ids[:, 0] = torch.randint(VOCAB, (BATCH,), generator=g)
            pick = torch.randint(4, (BATCH, SEQ), generator=g)
            for t in range(1, SEQ):
                ids[:, t] = succ[ids[:, t - 1], pick[:, t]]
            return ids

        return markov
    raise SystemExit(f"unknown task {task!r} (memorise, markov)")


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def train(cell: Cell, steps: int) -> dict[str, Any]:
    """Train one cell; the loss curve plus a few raw numbers of its first steps."""
    torch.manual_seed(cell.seed)
    model = build_model(cell.arch(), seed=cell.seed)
    batches = task_batches(cell.task, cell.seed)
    opt = torch.optim.AdamW(
        model.parameters(), lr=cell.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0
    )
    scores: list[float] = []
    hooks = [
        m.register_forward_hook(lambda _m, _i, out: scores.append(float(out.detach().abs().amax())))
        for m in model.modules()
        if isinstance(m, AttentionLogits)
    ]
    losses: list[float] = []
    attn_max: list[float] = []
    log_z: list[float] = []
    t0 = time.perf_counter()
    try:
        for t in range(steps):
            scores.clear()
            ids = batches(t)
            logits = model(ids)
            loss = lm_loss(logits, ids)
            losses.append(loss.item())
            if t <= SCAN_STEPS:
                attn_max.append(max(scores) if scores else float("nan"))
                log_z.append(float(logits.detach().float().logsumexp(-1).mean()))
            if not math.isfinite(losses[-1]):
                break
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    finally:
        for h in hooks:
            h.remove()
    return {
        "key": cell.key,
        "losses": losses,
        "attn_max": attn_max,
        "log_z": log_z,
        "train_s": round(time.perf_counter() - t0, 2),
    }


# ---- scan phase ------------------------------------------------------------------------


def scan_cell(cell: Cell) -> dict[str, Any]:
    """scan() the cell's configuration with SCAN_STEPS steps at its learning rate; keeps
    the whole Dynamics record, so the checks can be re-run offline with other thresholds
    (`judge`) without scanning again."""
    from actscan import scan

    model = build_model(cell.arch(), seed=cell.seed)
    batches = task_batches(cell.task, cell.seed)
    t0 = time.perf_counter()
    report = scan(
        model,
        inputs=batches,
        steps=SCAN_STEPS,
        lr=cell.lr,
        optimizer="adamw",
        betas=(0.9, 0.95),
        eps=1e-8,
        weight_decay=0.0,
        seed=cell.seed,
    )
    assert report.dynamics is not None
    return {
        "key": cell.key,
        "dynamics": asdict(report.dynamics),
        "arch": {k: v for k, v in report.model.arch.items() if k != "config"},
        "layers": [
            [r.name, r.type, r.role]
            for r in report.layers
            if r.type == "AttentionLogits" or r.role == "head"
        ],
        "scan_s": round(time.perf_counter() - t0, 2),
    }


def dynamics_from_dict(d: dict[str, Any]) -> Any:
    from actscan.records import (
        ChangeRecord,
        Dynamics,
        LogitStats,
        OptimizerInfo,
        StepRecord,
        UpdateRecord,
    )

    opt = dict(d["optimizer"])
    opt["betas"] = tuple(opt["betas"]) if opt.get("betas") else None
    steps = tuple(
        StepRecord(
            t=s["t"],
            loss=s["loss"],
            lr=s["lr"],
            stream=tuple(tuple(x) for x in s["stream"]),
            change=tuple(ChangeRecord(**c) for c in s["change"]),
            logits=LogitStats(**s["logits"]) if s.get("logits") else None,
            attn_max=s.get("attn_max"),
            gain_drift=tuple(tuple(x) for x in s.get("gain_drift", ())),
        )
        for s in d["steps"]
    )
    updates = tuple(
        UpdateRecord(**{**u, "ratio": tuple(u["ratio"]), "grad_rms": tuple(u["grad_rms"])})
        for u in d["updates"]
    )
    return Dynamics(
        optimizer=OptimizerInfo(**opt), steps=steps, updates=updates, probe=d.get("probe")
    )


def judge(row: dict[str, Any], thresholds: Any = None) -> dict[str, Any]:
    """Run the dynamics checks on a stored scan row: fired (warn/error) checks, info
    checks, and the numbers behind them."""
    from actscan.diagnose import CheckContext
    from actscan.diagnose.steps import DYNAMICS_CHECKS, numbers
    from actscan.diagnose.thresholds import DEFAULT
    from actscan.records import LayerRecord, Layout, ModelInfo, RunInfo, growth_fit

    dyn = dynamics_from_dict(row["dynamics"])
    layers = tuple(
        LayerRecord(name=n, type=t, role=r, block=None, calls=1) for n, t, r in row["layers"]
    )
    ctx = CheckContext(
        info=ModelInfo(source="calibration", family="actscan-gpt", n_params=0, arch=row["arch"]),
        run=RunInfo(),
        layout=Layout(),
        layers=layers,
        stream=(),
        fit=growth_fit(()),
        params=(),
        thresholds=thresholds or DEFAULT,
        dynamics=dyn,
    )
    from actscan.diagnose import CHECKS

    found = [
        f
        for ids, check in CHECKS.items()
        if ids[0].value in DYNAMICS_CHECKS
        for f in check(ctx)
        if not hasattr(f, "reason")
    ]
    fired = {f.check: str(f.severity) for f in found if str(f.severity) in ("warn", "error")}
    info = sorted({f.check for f in found} - set(fired))
    return {"fired": fired, "info": info, "numbers": numbers(dyn)}


# ---- labels and the report -------------------------------------------------------------


def final_loss(losses: list[float]) -> float:
    if not losses or not all(math.isfinite(x) for x in losses):
        return float("nan")
    return statistics.fmean(losses[-10:])


def spikes(losses: list[float], window: int = 10, jump: float = 1.0) -> int:
    """Steps whose loss is ≥ 2× the running median of the previous `window` and at least
    `jump` nats above it (the ratio alone flags wobbles of runs near 0)."""
    out = 0
    for t in range(window, len(losses)):
        med = statistics.median(losses[t - window : t])
        if losses[t] >= 2 * med and losses[t] - med >= jump:
            out += 1
    return out


def label(run: dict[str, Any], best: tuple[float, float]) -> tuple[bool, str]:
    """(unstable, why). `best` = (best final loss of the configuration, its lr)."""
    losses = run["losses"]
    if not losses or not all(math.isfinite(x) for x in losses):
        return True, "NaN"
    fin, start = final_loss(losses), losses[0]
    if fin > start:
        return True, "final > start"
    best_loss, best_lr = best
    if run["lr"] > best_lr and fin - best_loss >= 0.5 * (start - best_loss):
        return True, "fails to train"
    if spikes(losses):
        return True, "spike"
    return False, ""


def load(path: Path) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                out[row["key"]] = row
    return out


def append(path: Path, row: dict[str, Any]) -> None:
    with path.open("a") as fh:
        fh.write(json.dumps(row) + "\n")


def run_phase(
    name: str, cells: list[Cell], cache: Path, fn: Callable[[Cell], dict[str, Any]]
) -> None:
    done = load(cache)
    todo = [c for c in cells if c.key not in done]
    print(f"{name}: {len(cells) - len(todo)} cached, {len(todo)} to run → {cache}", flush=True)
    t0 = time.perf_counter()
    for i, cell in enumerate(todo):
        row = fn(cell)
        append(cache, row)
        took = time.perf_counter() - t0
        print(f"  [{i + 1}/{len(todo)} {took:.0f}s] {cell.key}", flush=True)


def rows(cells: list[Cell], trained: dict[str, Any], scanned: dict[str, Any]) -> Iterator[dict]:
    by_config: dict[str, list[dict[str, Any]]] = {}
    for c in cells:
        if c.key in trained:
            by_config.setdefault(c.config_key, []).append({**trained[c.key], "lr": c.lr})
    best = {}
    grid_lrs: dict[str, int] = {}
    for c in cells:
        grid_lrs[c.config_key] = grid_lrs.get(c.config_key, 0) + 1
    by_config = {k: v for k, v in by_config.items() if len(v) == grid_lrs[k]}
    for key, runs in by_config.items():
        finals = [(final_loss(r["losses"]), r["lr"]) for r in runs]
        finite_finals = [f for f in finals if math.isfinite(f[0])]
        best[key] = min(finite_finals) if finite_finals else (float("nan"), math.inf)
    for c in cells:
        if c.key not in trained or c.config_key not in by_config:
            continue  # a configuration without its whole lr grid cannot be labelled
        run = {**trained[c.key], "lr": c.lr}
        unstable, why = label(run, best[c.config_key])
        yield {
            "cell": c,
            "run": run,
            "unstable": unstable,
            "why": why,
            "final": final_loss(run["losses"]),
            "best": best[c.config_key][0],
            "scan": judge(scanned[c.key]) if c.key in scanned else None,
        }


def prf(pred: list[bool], truth: list[bool]) -> tuple[int, int, int, int]:
    tp = sum(p and t for p, t in zip(pred, truth, strict=True))
    fp = sum(p and not t for p, t in zip(pred, truth, strict=True))
    fn = sum(t and not p for p, t in zip(pred, truth, strict=True))
    tn = len(pred) - tp - fp - fn
    return tp, fp, fn, tn


def ratio(a: int, b: int) -> str:
    return f"{a / b:.2f}" if b else "–"


def report(cells: list[Cell], train_cache: Path, scan_cache: Path, out: Path | None) -> str:
    from actscan.diagnose.steps import DYNAMICS_CHECKS

    all_rows = [r for r in rows(cells, load(train_cache), load(scan_cache)) if r["scan"]]
    lines = [
        "| task | seed | placement | L | branch scale | qk_norm | lr | loss @0 | @10 | final "
        "| best of config | label | warn/error findings | info findings | update ratio | "
        "attn max | log Z drift | grad ≤ 10 eps | amp. shape |",
        "|" + "---|" * 19,
    ]
    for r in all_rows:
        c, s = r["cell"], r["scan"]
        nums = s["numbers"]
        fired = ", ".join(f"{k} ({v})" for k, v in sorted(s["fired"].items())) or "–"
        verdict = f"**unstable** ({r['why']})" if r["unstable"] else "ok"
        losses = r["run"]["losses"]
        lines.append(
            f"| {c.task} | {c.seed} | {c.placement} | {c.layers} | {c.branch} | "
            f"{'on' if c.qk else 'off'} | {c.lr:g} | {losses[0]:.2f} | "
            f"{losses[min(10, len(losses) - 1)]:.2f} | {r['final']:.2f} | {r['best']:.2f} | "
            f"{verdict} | {fired} | {', '.join(s['info']) or '–'} | "
            f"{_f(nums.get('update_max'))} | {_f(nums.get('attn_max'))} | "
            f"{_f(nums.get('log_z_drift'))} | {_pct(nums.get('eps_low_share'))} | "
            f"{_f(nums.get('amplification_sustain'))} |"
        )
    truth = [r["unstable"] for r in all_rows]
    summary = [
        "| check | fires (warn/error) | TP | FP | FN | TN | precision | recall | info only |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for check in [*DYNAMICS_CHECKS, "any"]:
        pred = [
            bool(r["scan"]["fired"]) if check == "any" else check in r["scan"]["fired"]
            for r in all_rows
        ]
        info = sum(check in r["scan"]["info"] for r in all_rows) if check != "any" else "–"
        tp, fp, fn, tn = prf(pred, truth)
        summary.append(
            f"| {'**any dynamics check**' if check == 'any' else '`' + check + '`'} | "
            f"{sum(pred)} | {tp} | {fp} | {fn} | {tn} | {ratio(tp, tp + fp)} | "
            f"{ratio(tp, tp + fn)} | {info} |"
        )
    groups = [
        "| subset | runs | unstable | flagged (warn/error) | precision | recall |",
        "|---|---|---|---|---|---|",
    ]
    subsets: list[tuple[str, Callable[[Cell], bool]]] = [
        ("depth 6", lambda c: c.layers == 6),
        ("depth 24", lambda c: c.layers == 24),
        ("Pre-LN", lambda c: c.placement == "pre"),
        ("Post-LN", lambda c: c.placement == "post"),
        ("qk_norm off", lambda c: not c.qk),
        ("qk_norm on", lambda c: c.qk),
        ("lr 3e-2, qk_norm off", lambda c: c.lr == 3e-2 and not c.qk),
        ("lr 3e-2, qk_norm on", lambda c: c.lr == 3e-2 and c.qk),
        ("lr ≤ 3e-3", lambda c: c.lr <= 3e-3),
    ]
    for name, keep in subsets:
        sub = [r for r in all_rows if keep(r["cell"])]
        if not sub:
            continue
        tp, fp, fn, _ = prf([bool(r["scan"]["fired"]) for r in sub], [r["unstable"] for r in sub])
        groups.append(
            f"| {name} | {len(sub)} | {sum(r['unstable'] for r in sub)} | {tp + fp} | "
            f"{ratio(tp, tp + fp)} | {ratio(tp, tp + fn)} |"
        )
    text = "\n".join(
        [
            f"{len(all_rows)} runs, {sum(truth)} unstable (base rate "
            f"{ratio(sum(truth), len(truth))}: the precision of flagging every run).",
            "",
            *summary,
            "",
            *groups,
            "",
            *lines,
            "",
        ]
    )
    if out is not None:
        body = out.read_text() if out.exists() else ""
        start, end = "<!-- calibration:begin -->", "<!-- calibration:end -->"
        if start in body and end in body:
            head, _, rest = body.partition(start)
            _, _, tail = rest.partition(end)
            out.write_text(f"{head}{start}\n{text}{end}{tail}")
        else:
            out.write_text(f"{body}\n{start}\n{text}{end}\n")
    return text


def _pct(x: float | None) -> str:
    if x is None:
        return "–"
    return "0" if x == 0 else f"{100 * x:.2g}%"


def _f(x: float | None) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    return f"{x:.3g}"


def _sets(text: str) -> list[tuple[str, int]]:
    return [(t, int(s)) for t, _, s in (x.partition(":") for x in text.split(","))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4 cells, 2 layers, 60 steps")
    ap.add_argument("--phase", default="all", choices=("train", "scan", "report", "all"))
    ap.add_argument("--cache", default="calibrate_dynamics", help="cache file prefix")
    ap.add_argument("--steps", type=int, default=150, help="training steps per run")
    ap.add_argument("--deep-steps", type=int, default=100, help="… for the 24-layer runs")
    ap.add_argument(
        "--sets", default="memorise:0,memorise:1,markov:0", help="task:seed pairs to run"
    )
    ap.add_argument("--deep-sets", default="memorise:0", help="… for the 24-layer runs")
    ap.add_argument("--out", default=None, help="Markdown file to update (between markers)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    steps = 60 if args.quick else args.steps
    cells = grid(_sets(args.sets), args.quick, _sets(args.deep_sets))
    prefix = args.cache + ("-quick" if args.quick else "")
    train_cache, scan_cache = Path(f"{prefix}-train.jsonl"), Path(f"{prefix}-scan.jsonl")
    if args.phase in ("train", "all"):
        deep = 60 if args.quick else args.deep_steps
        run_phase(
            "train", cells, train_cache, lambda c: train(c, deep if c.layers >= 24 else steps)
        )
    if args.phase in ("scan", "all"):
        run_phase("scan", cells, scan_cache, scan_cell)
    if args.phase in ("report", "all"):
        print(report(cells, train_cache, scan_cache, Path(args.out) if args.out else None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
