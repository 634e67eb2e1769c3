"""What a user pays for a scan: the whole `scan()` call and the whole `actscan profile`
process, beside the per-iteration figure, with the breakdown of every one-time cost.

    python benchmarks/scan_cost.py [--quick] [--device cpu|cuda] [--only call,e2e,rss,steps]
                                   [--models gpt2,builtin] [--reps N] [--threads N]

One command, one table (raw samples, machine and load go to
benchmarks/results/scan-cost-<timestamp>.json):
  call   in one process, interleaved (the order rotates every repetition), medians of wall
         and process CPU time, each ÷ plain forward + backward of the same batch:
         scan() with everything on (layout proof, at-init usage, attention probes, the
         per-token view), scan(attention=False), scan(at_init=False), the recorded pass
         alone (one iteration of the loop: hooks and attention probes, none of the
         one-time costs), and two anchors, each with its forward + backward:
         transformers' DebugUnderflowOverflow (forward hooks on every module, host syncs
         per tensor) and a naive hook calling .item() on every module's output mean, std
         and max |x|. Then one scan() call cut into its stages (layout, inputs, the
         recorded pass with what rides on it, reading the proof and the usage, parameter
         records, records, checks, report) and the forwards of the model it ran.
         Models: gpt2 = transformers' GPT2LMHeadModel from a GPT2Config (124M parameters,
         dropout 0, train mode, built in process: no download), builtin = the built-in
         family's configs/gpt2-124m.yaml; both seq 128, batch 4 (--seq, --batch).
  e2e    `actscan profile configs/gpt2-124m.yaml` ÷ benchmarks/handwritten_gpt2.py, each a
         process of its own, interleaved: wall and the children's CPU time.
  rss    peak RSS (getrusage ru_maxrss), each in a process of its own: scan() ÷ the plain
         pass; scan(steps=N) against N plain AdamW steps + one copy of the weights.
  steps  one optimizer step with the recorder ÷ one plain AdamW step (12 × 768, built-in,
         --step-batch × --step-seq tokens; benchmarks/overhead.py's `steps` section: the
         recorder's side inside the copy kept for the restore, as a scan takes them): steps
         t ≥ 2 of every run, each clocked, medians; t = 0 allocates the optimizer state
         and t = 1 first fills the run's peak memory, so the whole run of N steps (the
         restore included) is shown beside it. Then
         the stages of a step clocked (probe, batch, gradient norms, optimizer, update
         figures, host read), CPU seconds per step beside a plain step's.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import overhead  # noqa: E402  (benchmarks/overhead.py: machine facts, e2e, steps)

SECTIONS = ("call", "e2e", "rss", "steps")
MODELS = ("gpt2", "builtin")
TARGETS = {  # the performance issue's "done means"
    "scan() call": 1.10,
    "actscan profile end to end": 1.05,
    "optimizer step": 1.15,
    "peak RSS scan": 1.10,
    "peak RSS steps": 1.00,
}
# the stages of one scan() call: names in actscan.run, timed where they are called
STAGES = {
    "detect_layout": "layout: detect the blocks",
    "choose_inputs": "inputs: choose the batches and loss",
    "record_pass": "recorded pass (+ proof, usage hooks riding on it)",
    "probe_read": "read the proof + at-init usage, probe norm gains",
    "param_records": "parameter records (moments of every weight)",
    "build_records": "layer / stream records",
    "checks": "checks",
    "report_of": "report",
}


# -- models ----------------------------------------------------------------------------------
def build(name: str, device: str) -> Any:
    """The 124M model `name`, train mode, dropout 0 (what a scan runs), on `device`."""
    import torch

    torch.manual_seed(0)
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model: torch.nn.Module = GPT2LMHeadModel(cfg)
    else:
        from actscan.models.arch import build_config, read_config_file
        from actscan.models.gpt import build_model

        path = "configs/gpt2-124m.yaml"
        model = build_model(build_config(read_config_file(ROOT / path), path), seed=0)
    return model.to(device).train()


def token_ids(model: Any, batch: int, seq: int, device: str) -> Any:
    import torch

    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (batch, seq), generator=gen).to(device)


class Calls:
    """The ways of running one batch that the `call` section times."""

    def __init__(self, name: str, device: str, batch: int, seq: int) -> None:
        self.name, self.device = name, device
        self.model = build(name, device)
        self.ids = token_ids(self.model, batch, seq, device)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.hf = name == "gpt2"

    def _inputs(self) -> Any:
        return {"input_ids": self.ids} if self.hf else self.ids

    def _forward_backward(self) -> None:
        import torch

        from actscan.measure.inputs import next_token_loss

        out = self.model(**self._inputs()) if self.hf else self.model(self.ids)
        logits = out.logits if self.hf else out
        torch.autograd.grad(next_token_loss(logits, self.ids), self.params, allow_unused=True)

    def plain(self) -> None:
        self._forward_backward()

    def scan(self, **kw: Any) -> Any:
        from actscan import scan

        return scan(self.model, self._inputs(), device=self.device, **kw)

    def recorded(self) -> None:
        """The recorded pass alone: the loop's hooks and attention probes on one batch,
        read back once; no proof, usage, records or checks."""
        from actscan.layout.detect import detect_layout
        from actscan.measure.model_inputs import choose_inputs
        from actscan.measure.profile import LocalPass, record_pass
        from actscan.run import pass_spec, scan_settings
        from actscan.targets.info import infer_info

        info = infer_info(self.model)
        s = scan_settings(device=self.device)
        chosen = choose_inputs(
            self.model, info, self._inputs(), None, batch=4, seq_len=None, seed=0
        )
        layout = detect_layout(self.model, info.family)
        record_pass(self.model, layout, chosen, pass_spec(self.model, s, info), LocalPass())

    def debug_underflow_overflow(self) -> None:
        from transformers.debug_utils import DebugUnderflowOverflow

        dbg = DebugUnderflowOverflow(self.model)  # registers its hooks, keeps no handles
        try:
            self._forward_backward()
        finally:
            for m in self.model.modules():
                for key, hook in list(m._forward_hooks.items()):
                    if getattr(hook, "__self__", None) is dbg:
                        del m._forward_hooks[key]

    def item_hook(self) -> None:
        """A naive hook: mean, std and max |x| of every module's output, each `.item()`."""
        import torch

        seen: list[tuple[float, float, float]] = []

        def hook(_m: Any, _a: Any, out: Any) -> None:
            t = (
                out
                if isinstance(out, torch.Tensor)
                else next(
                    (
                        x
                        for x in (out if isinstance(out, tuple) else ())
                        if isinstance(x, torch.Tensor)
                    ),
                    None,
                )
            )
            if t is not None and t.is_floating_point():
                d = t.detach()
                seen.append((d.mean().item(), d.std().item(), d.abs().max().item()))

        handles = [m.register_forward_hook(hook) for m in self.model.modules()]
        try:
            self._forward_backward()
        finally:
            for h in handles:
                h.remove()


# glibc's malloc returns a freed block above its mmap threshold to the kernel at once, and a
# VM with free page reporting (Firecracker) hands those pages to its host: every pass then
# faults its activations in again. On the 2-core VM the figures come from, that is ~300k
# minor faults and 0.5-1.1 s of system time per GPT-2 pass, moving run to run by more than
# the overhead measured. These settings keep freed memory in the process for plain and
# scanned runs alike (the e2e processes inherit them; the rss ones do not); the faults and
# system time of every sample are recorded either way.
KEEP_PAGES = {
    "MALLOC_MMAP_THRESHOLD_": str(1 << 34),
    "MALLOC_TRIM_THRESHOLD_": str(1 << 34),
    "MALLOC_TOP_PAD_": str(1 << 30),
}


def keeps_pages() -> bool:
    return all(os.environ.get(k) == v for k, v in KEEP_PAGES.items())


def timed(fn: Callable[[], object], device: str) -> tuple[float, float]:
    gc.collect()
    overhead.sync(device)
    w, c = time.perf_counter(), time.process_time()
    fn()
    overhead.sync(device)
    return time.perf_counter() - w, time.process_time() - c


@contextlib.contextmanager
def clocked(into: dict[str, list[float]], where: list[tuple[Any, str, str]]) -> Iterator[None]:
    """Time each call of `owner.attr` inside, wall and CPU, under `key` and `key cpu`, for
    each (owner, attr, key) of `where`; the originals are put back afterwards."""
    saved: list[tuple[Any, str, Any]] = []

    def clock(owner: Any, attr: str, key: str) -> None:
        f = getattr(owner, attr)

        @functools.wraps(f)
        def g(*a: Any, **k: Any) -> Any:
            w, c = time.perf_counter(), time.process_time()
            try:
                return f(*a, **k)
            finally:
                into.setdefault(key, []).append(time.perf_counter() - w)
                into.setdefault(key + " cpu", []).append(time.process_time() - c)

        saved.append((owner, attr, f))
        setattr(owner, attr, g)

    try:
        for owner, attr, key in where:
            clock(owner, attr, key)
        yield
    finally:
        for owner, attr, f in reversed(saved):
            setattr(owner, attr, f)


@contextlib.contextmanager
def stage_clock(into: dict[str, list[float]]) -> Iterator[None]:
    """Time the stages of scan() calls run inside: each STAGES name, wall and CPU, as it
    is called by actscan.run (and the proof's read, a method of PassProbe)."""
    import actscan.run as run
    from actscan.layout.probe import PassProbe

    where: list[tuple[Any, str, str]] = [
        (run, key, key) for key in STAGES if key not in ("checks", "probe_read")
    ]
    where += [(PassProbe, "probe", "probe_read"), (run, "evaluate", "checks")]
    defaults = run.scan_model.__kwdefaults__
    assert defaults is not None  # scan_model's keyword-only parameters have defaults
    saved_default = defaults["checks"]
    with clocked(into, where):
        defaults["checks"] = run.evaluate  # bound as scan_model's default: set it there too
        try:
            yield
        finally:
            defaults["checks"] = saved_default


# the stages of one optimizer step with the recorder (actscan.steps.loop._Loop), timed
STEP_STAGES = {
    "run_probe": "the probe's forward (no gradient), its change sums, log Z",
    "run_batch": "the step's forward + backward, with its stream taps",
    "grad_sq": "the gradients' norms",
    "optimizer": "the optimizer's own step (piece by piece on a CPU, else bucket by bucket)",
    "piecewise_step": "the optimizer + the update figures (W_t copy, ‖W_t‖, ‖ΔW‖, drift)",
    "bucketed_step": "the optimizer + the update figures, bucket by bucket (a GPU's path)",
    "read": "the host's figures (one transfer)",
}


def bench_step_stages(device: str, n: int, batch: int, seq: int, reps: int) -> dict[str, Any]:
    """`reps` runs of N steps with the recorder, every stage of a step clocked (CPU and
    wall seconds per step, medians over the runs), beside the plain steps' time per step."""
    import torch

    import actscan.steps.loop as loop

    st = overhead.OptimizerSteps(device, n, batch, seq)
    st.instrumented()  # warm-up
    st.reset()
    per_run: list[dict[str, float]] = []
    plain: list[float] = []
    for _ in range(reps):
        got: dict[str, list[float]] = {}
        where: list[tuple[Any, str, str]] = [
            (loop._Loop, k, k)
            for k in ("run_probe", "run_batch", "piecewise_step", "bucketed_step", "read")
        ]
        # the step (AdamW's own attribute since the warm-up's optimizer patched it)
        where += [(loop, "_grad_sq", "grad_sq"), (torch.optim.AdamW, "step", "optimizer")]
        with clocked(got, where):
            st.instrumented()
        st.reset()
        per_run.append({k: sum(v) / n for k, v in got.items()})
        plain.append(timed(st.plain, device)[1] / n)
        st.reset()
    keys = per_run[0]
    return {
        "steps": n,
        "plain_step_cpu": statistics.median(plain),
        "per_step": {k: statistics.median(r[k] for r in per_run) for k in keys},
    }


def forwards_of(calls: Calls, fn: Callable[[], object]) -> int:
    """How many times fn runs the model's forward (its root module's calls)."""
    n = [0]
    handle = calls.model.register_forward_pre_hook(lambda *_: n.__setitem__(0, n[0] + 1))
    try:
        fn()
    finally:
        handle.remove()
    return n[0]


def bench_call(name: str, device: str, reps: int, batch: int, seq: int) -> dict[str, Any]:
    calls = Calls(name, device, batch, seq)
    fns: dict[str, Callable[[], object]] = {
        "plain": calls.plain,
        "scan": calls.scan,
        "scan attention=False": functools.partial(calls.scan, attention=False),
        "scan at_init=False": functools.partial(calls.scan, at_init=False),
        "recorded pass alone": calls.recorded,
        "naive .item() hook": calls.item_hook,
    }
    if calls.hf:
        fns["DebugUnderflowOverflow"] = calls.debug_underflow_overflow
    for fn in fns.values():  # warm-up
        fn()
    samples: dict[str, dict[str, list[float]]] = {
        k: {"wall": [], "cpu": [], "faults": [], "sys": []} for k in fns
    }
    keys = list(fns)
    loads = []
    for r in range(reps):
        order = keys[r % len(keys) :] + keys[: r % len(keys)]
        for k in order:
            before = resource.getrusage(resource.RUSAGE_SELF)
            w, c = timed(fns[k], device)
            after = resource.getrusage(resource.RUSAGE_SELF)
            samples[k]["wall"].append(w)
            samples[k]["cpu"].append(c)
            samples[k]["faults"].append(after.ru_minflt - before.ru_minflt)
            samples[k]["sys"].append(after.ru_stime - before.ru_stime)
        loads.append(os.getloadavg()[0])
    med = {k: {m: statistics.median(v) for m, v in s.items()} for k, s in samples.items()}
    base = med["plain"]
    stages: dict[str, list[float]] = {}
    with stage_clock(stages):
        for _ in range(max(1, reps // 2)):
            timed(calls.scan, device)
    return {
        "model": name,
        "batch": batch,
        "seq_len": seq,
        "reps": reps,
        "load": loads,
        "samples": samples,
        "median": med,
        "ratio": {k: v["wall"] / base["wall"] for k, v in med.items()},
        "ratio_cpu": {k: v["cpu"] / base["cpu"] for k, v in med.items()},
        # the median of each round's own ratio: a drift of the machine's speed between
        # rounds cancels (both sides of a round ran minutes apart at most)
        "ratio_paired_cpu": {
            k: statistics.median(
                a / b for a, b in zip(s["cpu"], samples["plain"]["cpu"], strict=True)
            )
            for k, s in samples.items()
        },
        "stages": {k: statistics.median(v) for k, v in stages.items()},
        "forwards": {
            "plain": forwards_of(calls, calls.plain),
            "scan": forwards_of(calls, calls.scan),
        },
        "parameters": sum(p.numel() for p in calls.params),
    }


# -- memory: one process per figure ------------------------------------------------------------
def child(argv: list[str]) -> None:
    """`--child MODE NAME DEVICE BATCH SEQ STEPS`: one run, its peak RSS as a JSON line."""
    mode, name, device = argv[0], argv[1], argv[2]
    batch, seq, steps = int(argv[3]), int(argv[4]), int(argv[5])
    import torch

    calls = Calls(name, device, batch, seq)
    built = overhead.peak_rss_mb()
    weights_mb = sum(p.numel() * p.element_size() for p in calls.params) / 2**20
    if mode == "plain":
        calls.plain()
    elif mode == "scan":
        calls.scan()
    elif mode == "plain-steps":  # N AdamW steps on the same batch, as the scan's loop takes them
        from actscan.measure.inputs import next_token_loss

        opt = torch.optim.AdamW(calls.params, lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
        for _ in range(steps):
            out = calls.model(**calls._inputs()) if calls.hf else calls.model(calls.ids)
            loss = next_token_loss(out.logits if calls.hf else out, calls.ids)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    elif mode == "scan-steps":
        calls.scan(steps=steps)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    print(
        json.dumps({"peak_mb": overhead.peak_rss_mb(), "built_mb": built, "weights_mb": weights_mb})
    )


def run_child(args: list[str], threads: int | None) -> dict[str, Any]:
    """A memory figure's process, always under glibc's defaults: with freed pages kept
    (`--keep-pages`) a peak RSS would count memory the defaults give back."""
    return overhead.run_child(args, threads, script=__file__, drop=KEEP_PAGES)


def bench_rss(
    name: str, device: str, threads: int | None, batch: int, seq: int, steps: int
) -> dict[str, Any]:
    size = [name, device, str(batch), str(seq), str(steps)]
    got = {
        mode: run_child([mode, *size], threads)
        for mode in ("plain", "scan", "plain-steps", "scan-steps")
    }
    plain, scan = got["plain"]["peak_mb"], got["scan"]["peak_mb"]
    budget = got["plain-steps"]["peak_mb"] + got["plain-steps"]["weights_mb"]
    return {
        "model": name,
        "steps": steps,
        "runs": got,
        "ratio_scan": scan / plain,
        "steps_budget_mb": budget,
        "ratio_steps": got["scan-steps"]["peak_mb"] / budget,
    }


# -- report ----------------------------------------------------------------------------------
def rows(res: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    out: list[tuple[str, str, str, str]] = []

    def add(measure: str, shown: str, key: str | None = None, value: float | None = None) -> None:
        if key is None or value is None:
            out.append((measure, shown, "", ""))
            return
        limit = TARGETS[key]
        verdict = "ok" if value <= limit else f"MISSED by {value / limit - 1:.0%}"
        out.append((measure, shown, f"≤ {limit:g}", verdict))

    for name in MODELS:
        c = res.get(f"call {name}")
        if not c:
            continue
        med, ratio, cpu = c["median"], c["ratio"], c["ratio_cpu"]
        tag = f"{name} {c['parameters'] / 1e6:.0f}M, {c['batch']}×{c['seq_len']}"
        base = med["plain"]
        faults = (
            f"; {base['faults'] / 1e3:.0f}k page faults, sys {base['sys']:.2f} s per pass"
            if "faults" in base
            else ""
        )
        add(
            f"plain forward + backward ({tag})",
            f"{base['wall']:.2f} s (cpu {base['cpu']:.2f} s){faults}",
        )
        for k in med:
            if k == "plain":
                continue
            paired = c.get("ratio_paired_cpu", {}).get(k)
            by_round = f", per round {paired:.3f}×" if paired is not None else ""
            shown = f"{ratio[k]:.3f}×  (cpu {cpu[k]:.3f}×{by_round}; {med[k]['wall']:.2f} s)"
            if k == "scan":
                fw = c["forwards"]
                shown += f"; forwards per call {fw['scan']} (plain {fw['plain']})"
                add("  whole scan() call, everything on", shown, "scan() call", ratio[k])
            else:
                add(f"  {k}", shown)
        for key, label in STAGES.items():
            if key in c["stages"]:
                add(
                    f"    stage: {label}",
                    f"{c['stages'][key]:.3f} s (cpu {c['stages'][key + ' cpu']:.3f} s)",
                )
    if "e2e" in res:
        e = res["e2e"]
        med = e["median"]
        shown = f"{e['ratio']:.3f}×  ({med['handwritten']:.2f} s → {med['profile']:.2f} s)"
        if "ratio_cpu" in e:  # the children's CPU time: what the load moves least
            shown += f"; cpu {e['ratio_cpu']:.3f}×"
        add(
            "actscan profile configs/gpt2-124m.yaml ÷ hand-written",
            shown,
            "actscan profile end to end",
            e["ratio"],
        )
    for name in MODELS:
        r = res.get(f"rss {name}")
        if not r:
            continue
        runs = r["runs"]
        plain, scan = runs["plain"]["peak_mb"], runs["scan"]["peak_mb"]
        shown = f"{r['ratio_scan']:.3f}×  ({plain:.0f} → {scan:.0f} MB)"
        add(f"peak RSS scan() ÷ plain pass ({name})", shown, "peak RSS scan", r["ratio_scan"])
        shown = (
            f"{r['ratio_steps']:.3f}×  ({runs['scan-steps']['peak_mb']:.0f} MB vs "
            f"{runs['plain-steps']['peak_mb']:.0f} + {runs['plain-steps']['weights_mb']:.0f} MB)"
        )
        add(
            f"peak RSS scan(steps={r['steps']}) ÷ (plain steps + weights) ({name})",
            shown,
            "peak RSS steps",
            r["ratio_steps"],
        )
    if "steps" in res:
        s = res["steps"]
        m = s["step_median"]
        shown = (
            f"{s['ratio_step']:.3f}×  (cpu {s['ratio_step_cpu']:.3f}×; steps t ≥ "
            f"{s['steady_from']} of each run: {m['plain']['wall']:.2f} → "
            f"{m['instrumented']['wall']:.2f} s; page faults {m['plain']['faults']:.0f} → "
            f"{m['instrumented']['faults']:.0f})"
        )
        add(
            "one optimizer step with the recorder ÷ plain AdamW",
            shown,
            "optimizer step",
            s["ratio_step"],
        )
        shown = (
            f"{s['ratio']:.3f}×  (cpu {s['ratio_cpu']:.3f}×; {s['steps']} steps, {s['batch']}×"
            f"{s['seq_len']}: {s['median']['plain']['wall']:.2f} → "
            f"{s['median']['instrumented']['wall']:.2f} s)"
        )
        add("  the whole run: N steps with the recorder ÷ N plain AdamW", shown)
    if "step stages" in res:
        g = res["step stages"]
        base = g["plain_step_cpu"]
        add("  one plain AdamW step (cpu)", f"{base:.3f} s")
        for key, label in STEP_STAGES.items():
            if key + " cpu" in g["per_step"]:
                v = g["per_step"][key + " cpu"]
                add(f"    step stage: {label}", f"{v:.3f} s cpu per step ({v / base:.1%} of plain)")
    return out


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 repetitions, gpt2 only")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"subset of {SECTIONS}")
    ap.add_argument("--models", default=None, help=f"subset of {MODELS}")
    ap.add_argument(
        "--reps", type=int, default=None, help="timed runs of each (default 5; quick 3)"
    )
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps-n", type=int, default=5, help="optimizer steps (rss, steps)")
    ap.add_argument("--step-batch", type=int, default=4, help="sequences per step (steps)")
    ap.add_argument("--step-seq", type=int, default=64, help="tokens per sequence (steps)")
    ap.add_argument("--out", type=Path, default=overhead.RESULTS)
    ap.add_argument(
        "--keep-pages",
        action="store_true",
        help="rerun under glibc settings that keep freed memory in the process (both sides "
        "of every time figure; the rss processes keep glibc's defaults)",
    )
    args = ap.parse_args()
    if args.keep_pages and not keeps_pages():
        os.execve(sys.executable, [sys.executable, *sys.argv], os.environ | KEEP_PAGES)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    models = [m for m in (args.models or ("gpt2" if args.quick else ",".join(MODELS))).split(",")]
    reps = args.reps or (3 if args.quick else 5)
    t0 = time.perf_counter()
    res: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": overhead.machine(args.device),
        "load_before": os.getloadavg(),
        "args": vars(args) | {"out": str(args.out)},
    }
    res["machine"]["allocator"] = (
        "glibc, freed pages kept (--keep-pages)" if keeps_pages() else "glibc defaults"
    )
    # processes first: a child's ru_maxrss starts from its parent's mark at exec (Linux)
    if "rss" in only:
        for name in models:
            print(f"peak RSS, {name} (4 processes) ...", flush=True)
            res[f"rss {name}"] = bench_rss(
                name, args.device, args.threads, args.batch, args.seq, args.steps_n
            )
    if "e2e" in only:
        n = 3 if args.quick else 5
        print(f"actscan profile vs hand-written: {n} interleaved pairs ...", flush=True)
        res["e2e"] = overhead.bench_e2e(args.device, n, args.threads)
    if "call" in only:
        for name in models:
            print(f"scan() call, {name}: {reps} interleaved rounds ...", flush=True)
            res[f"call {name}"] = bench_call(name, args.device, reps, args.batch, args.seq)
    if "steps" in only:
        n = 3 if args.quick else 5
        print(
            f"{args.steps_n} optimizer steps with the recorder vs by hand: {n} pairs ...",
            flush=True,
        )
        res["steps"] = overhead.bench_steps(
            args.device, n, args.steps_n, args.step_batch, args.step_seq
        )
        print("the stages of a step with the recorder ...", flush=True)
        res["step stages"] = bench_step_stages(
            args.device, args.steps_n, args.step_batch, args.step_seq, 2 if args.quick else 3
        )
    overhead.finish(res, rows(res), args.out, args.device, t0, prefix="scan-cost-")


if __name__ == "__main__":
    main()
