"""What measuring costs: the actscan overhead benchmark (stdlib + torch only).

    python benchmarks/overhead.py [--quick] [--device cpu|cuda] [--only overhead,rss,...]
                                  [--models 12x768,48x256]

Measures, and prints as a table (raw samples and machine facts go to
benchmarks/results/<timestamp>.json so runs can be compared across commits):
  tokens    the per-token view's share: instrumented with it (as scan() runs) ÷ without
            it (the recorder before issue 13), interleaved pairs, both models.
  overhead  instrumented ÷ plain forward+backward, in this process, interleaved, median
            of ≥ 5 runs after a warm-up: every module hooked, per-channel statistics and
            gradients on, the Recorder driven exactly as actscan.measure.profile drives it. Models:
            configs/gpt2-124m.yaml (12 × 768, seq 256, batch 4) and configs/gpt-48-naive
            .yaml (48 × 256, seq 64, batch 4: small tensors, many hooks: hook-bound).
  rss       peak RSS (resource.getrusage) of an instrumented ÷ a plain 12 × 768 batch
            (model built, one forward+backward), each in its own process.
  batches   peak RSS of scan(batches=N) for N = 1, 4, 16 (48 × 256): must stay flat.
  help      wall time of `actscan --help`, and that it imports neither torch nor
            transformers.
  e2e       `actscan profile configs/gpt2-124m.yaml` end to end vs benchmarks/
            handwritten_gpt2.py (build the same model + one forward/backward, same batch).
  steps     `--steps N` at 12 × 768 (--step-batch × --step-seq tokens, default 4 × 64: the
            profile's default batch, whose probe is a quarter of it, one sequence; small
            enough for a loaded CPU): N optimizer steps measured by actscan.steps.loop
            (the step-0 gradient pass, then run_steps: probe forward, stream taps, update
            ratios, gradient RMS, gain drift, one transfer per step) ÷ the same N AdamW steps
            written by hand (fwd+bwd+step per batch, plus the final loss), interleaved;
            the weights are reset between runs, untimed.
  steps-e2e `actscan profile configs/gpt2-124m.yaml --steps 10` end to end ÷
            `benchmarks/handwritten_gpt2.py --steps 10` (build + 10 AdamW steps), same
            batch (--step-batch × --step-seq); wall and the children's CPU time, and, in
            this process, the CPU seconds profile pays once (layout self-check, at-init
            pass, the copy of the caller's weights and the restore).
  attention attention probes on ÷ off: a transformers GPT-2 config (12 × 768, 12 heads,
            vocab 50257) with eager attention, seq 256, batch --attn-batch (2), forward +
            next-token loss + backward, interleaved, median; the probes are entered and
            their records read once per run, as a scan does.
Wall time is what the targets are about; process CPU time is recorded alongside, as it
is less disturbed by other processes sharing the cores.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
SECTIONS = (
    "overhead",
    "tokens",
    "rss",
    "batches",
    "help",
    "e2e",
    "steps",
    "steps-e2e",
    "attention",
)
# name -> (config file, batch, seq_len)
MODELS = {
    "12x768": ("configs/gpt2-124m.yaml", 4, 256),
    "48x256": ("configs/gpt-48-naive.yaml", 4, 64),
}
TARGETS = {  # upper bounds, from the performance issue
    "overhead 12x768": 1.05,
    "overhead 48x256": 1.20,
    "peak RSS 12x768": 1.10,
    "actscan --help (s)": 0.30,
    "profile end-to-end": 1.00,
    "RSS batches 16 / 1": 1.05,
    "optimizer step 12x768 (one step)": 1.15,
    "optimizer step 12x768 (whole run)": 1.15,
    "profile --steps 10 end-to-end": 1.20,
    "attention probes 12x768": 1.15,
    "per-token view 12x768": 1.03,
    "per-token view 48x256": 1.05,
}


# -- the measured steps (shared by this process and the child processes) ----------------
def build(name: str, device: str) -> tuple[Any, Any]:
    """The model of MODELS[name] and one batch of random token ids on `device`."""
    import torch

    from actscan.models.arch import build_config, read_config_file
    from actscan.models.gpt import build_model

    path, batch, seq = MODELS[name]
    cfg = build_config(read_config_file(ROOT / path), path)
    model = build_model(cfg, seed=0).to(device).eval()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen).to(device)
    return model, ids


class Steps:
    """plain and instrumented forward+backward of one batch.

    instrumented = one iteration of actscan.measure.profile's batch loop: every module hooked (and
    the stream input), per-channel statistics and gradients on, add_param_grads and
    end_batch; the Recorder lives across batches as in a scan with --batches N (its
    hooks are registered and removed around each batch, since plain runs interleave).
    What a scan pays once (building the Recorder, reading result()) is `per_scan()`.
    """

    def __init__(self, model: Any, ids: Any, device: str, tokens: bool = True) -> None:
        from actscan.layout.detect import detect_layout
        from actscan.measure.tokens import stream_names

        self.model, self.ids, self.device = model, ids, device
        self.params = [p for p in model.parameters() if p.requires_grad]
        layout = detect_layout(model, "actscan-gpt")
        first = layout.blocks[0].name
        self.stream = (f"{first}:input", model.get_submodule(first))
        # the per-token view's stream points, as scan() asks for them
        self.tokens = (
            stream_names([b.name for b in layout.blocks], [self.stream[0]], layout.embed)
            if tokens
            else []
        )
        self.batches = 0
        self.rec = self.recorder()

    def recorder(self) -> Any:
        from actscan.measure.recorder import Recorder, iter_named

        targets = list(iter_named(self.model, None))
        return Recorder(
            targets,
            stream_input=self.stream,
            backward=True,
            channels=True,
            device=self.device,
            tokens=self.tokens,
        )

    def plain(self) -> None:
        import torch

        from actscan.measure.inputs import next_token_loss

        loss = next_token_loss(self.model(self.ids), self.ids)
        torch.autograd.grad(loss, self.params, allow_unused=True)

    def instrumented(self) -> None:
        import torch

        from actscan.measure.inputs import next_token_loss

        with self.rec as rec:
            loss = next_token_loss(self.model(self.ids), self.ids)
            grads = torch.autograd.grad(loss, self.params, allow_unused=True)
            rec.add_param_grads(dict(zip(self.params, grads, strict=True)))
            del loss, grads
            rec.end_batch()
        self.batches += 1

    def per_scan(self) -> float:
        """Seconds a scan spends once: a Recorder built, and result() read at the end."""
        t = time.perf_counter()
        self.recorder()
        built = time.perf_counter() - t
        t = time.perf_counter()
        self.rec.result(max(self.batches, 1))
        sync(self.device)
        return built + time.perf_counter() - t


def sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def peak_rss_mb() -> float:
    """Peak RSS of this process (resource.getrusage; KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


# -- child processes ----------------------------------------------------------------------
def child(argv: list[str]) -> None:
    """`--child rss NAME MODE DEVICE` or `--child batches N DEVICE`: print one JSON line."""
    kind = argv[0]
    if kind == "rss":
        name, mode, device = argv[1:4]
        model, ids = build(name, device)
        base = peak_rss_mb()
        st = Steps(model, ids, device)
        getattr(st, mode)()  # one batch, as `actscan profile` runs
        if mode == "instrumented":
            st.per_scan()
        print(json.dumps({"peak_mb": peak_rss_mb(), "after_build_mb": base}))
    elif kind == "batches":
        n, device = int(argv[1]), argv[2]
        from actscan.run import scan

        model, _ = build("48x256", device)
        _, batch, seq = MODELS["48x256"]
        scan(model, batches=n, batch=batch, seq_len=seq, device=device)
        print(json.dumps({"peak_mb": peak_rss_mb()}))
    else:
        raise SystemExit(f"unknown child {kind!r}")


def run_child(
    args: list[str], threads: int | None, script: str = __file__, drop: Iterable[str] = ()
) -> dict[str, Any]:
    """Run `script --child ARGS` in a fresh process (its own peak RSS, its own threads),
    without the environment variables in `drop`, and return the JSON of its last line."""
    dropped = set(drop)
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    out = subprocess.run(
        [sys.executable, script, "--child", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


# -- sections -------------------------------------------------------------------------------
def time_once(fn: Callable[[], object], device: str) -> tuple[float, float]:
    gc.collect()
    sync(device)
    w, c = time.perf_counter(), time.process_time()
    fn()
    sync(device)
    return time.perf_counter() - w, time.process_time() - c


def bench_overhead(name: str, device: str, reps: int, warmup: int) -> dict[str, Any]:
    """Interleaved (plain, instrumented) pairs, alternating which goes first."""
    model, ids = build(name, device)
    st = Steps(model, ids, device)
    fns = {"plain": st.plain, "instrumented": st.instrumented}
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples: dict[str, dict[str, list[float]]] = {k: {"wall": [], "cpu": []} for k in fns}
    gpu_peak: dict[str, float] = {}
    for r in range(reps):
        order = ("plain", "instrumented") if r % 2 == 0 else ("instrumented", "plain")
        for k in order:
            if device.startswith("cuda"):
                import torch

                torch.cuda.reset_peak_memory_stats()
            w, c = time_once(fns[k], device)
            samples[k]["wall"].append(w)
            samples[k]["cpu"].append(c)
            if device.startswith("cuda"):
                gpu_peak[k] = max(gpu_peak.get(k, 0.0), torch.cuda.max_memory_allocated() / 2**20)
    per_scan = st.per_scan()
    med = {k: {m: statistics.median(v) for m, v in s.items()} for k, s in samples.items()}
    # per-pair ratios too: robust to slow drifts of the machine's load
    pairs = [
        i / p
        for i, p in zip(samples["instrumented"]["wall"], samples["plain"]["wall"], strict=True)
    ]
    _, batch, seq = MODELS[name]
    return {
        "model": name,
        "batch": batch,
        "seq_len": seq,
        "reps": reps,
        "warmup": warmup,
        "samples": samples,
        "median": med,
        "ratio": med["instrumented"]["wall"] / med["plain"]["wall"],
        "ratio_cpu": med["instrumented"]["cpu"] / med["plain"]["cpu"],
        "ratio_pairs_median": statistics.median(pairs),
        "per_scan_s": per_scan,
        "gpu_peak_mb": gpu_peak or None,
        "ratio_one_batch_scan": (med["instrumented"]["wall"] + per_scan) / med["plain"]["wall"],
    }


def bench_attention(device: str, reps: int, batch: int) -> dict[str, Any]:
    """Attention probes on ÷ off on a transformers GPT-2 (eager attention), seq 256."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from actscan.measure.attention import AttentionProbes
    from actscan.measure.inputs import next_token_loss

    cfg = AutoConfig.for_model("gpt2", n_layer=12, n_embd=768, n_head=12)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").to(device).eval()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (batch, 256), generator=gen).to(device)
    params = [p for p in model.parameters() if p.requires_grad]

    def step() -> None:
        loss = next_token_loss(model(input_ids=ids).logits, ids)
        torch.autograd.grad(loss, params, allow_unused=True)

    def probed() -> None:
        with AttentionProbes(model) as probes:
            step()
        assert len(probes.records()) == 12

    fns = {"plain": step, "probed": probed}
    for fn in fns.values():
        fn()
    samples: dict[str, list[float]] = {k: [] for k in fns}
    cpu: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(reps):
        for k in ("plain", "probed") if r % 2 == 0 else ("probed", "plain"):
            w, c = time_once(fns[k], device)
            samples[k].append(w)
            cpu[k].append(c)
    med = {k: statistics.median(v) for k, v in samples.items()}
    pairs = [a / b for a, b in zip(samples["probed"], samples["plain"], strict=True)]
    return {
        "batch": batch,
        "seq_len": 256,
        "reps": reps,
        "samples": samples,
        "cpu": cpu,
        "median": med,
        "ratio": med["probed"] / med["plain"],
        "ratio_pairs_median": statistics.median(pairs),
        "ratio_cpu": statistics.median(cpu["probed"]) / statistics.median(cpu["plain"]),
    }


def bench_tokens(name: str, device: str, reps: int, warmup: int) -> dict[str, Any]:
    """Instrumented with the per-token view ÷ without it: interleaved pairs."""
    model, ids = build(name, device)
    on, off = Steps(model, ids, device, tokens=True), Steps(model, ids, device, tokens=False)
    fns = {"on": on.instrumented, "off": off.instrumented}
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(reps):
        for k in ("on", "off") if r % 2 == 0 else ("off", "on"):
            samples[k].append(time_once(fns[k], device)[0])
    med = {k: statistics.median(v) for k, v in samples.items()}
    pairs = [a / b for a, b in zip(samples["on"], samples["off"], strict=True)]
    return {
        "model": name,
        "samples": samples,
        "median": med,
        "ratio": med["on"] / med["off"],
        "ratio_pairs_median": statistics.median(pairs),
    }


def bench_rss(device: str, threads: int | None) -> dict[str, Any]:
    plain = run_child(["rss", "12x768", "plain", device], threads)
    instr = run_child(["rss", "12x768", "instrumented", device], threads)
    return {"plain": plain, "instrumented": instr, "ratio": instr["peak_mb"] / plain["peak_mb"]}


def bench_batches(device: str, threads: int | None, ns: tuple[int, ...]) -> dict[str, Any]:
    peaks = {n: run_child(["batches", str(n), device], threads)["peak_mb"] for n in ns}
    return {"peak_mb": peaks, "ratio": peaks[ns[-1]] / peaks[ns[0]]}


def actscan_cmd() -> list[str]:
    exe = Path(sys.executable).with_name("actscan")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "actscan"]


@functools.cache
def compile_sources() -> None:
    """Byte-compile actscan and the benchmarks, as `pip install` does for a wheel, before
    timing processes: where PYTHONDONTWRITEBYTECODE is set (this project's CI machines
    set it), every process of an editable install would otherwise compile ~100 modules
    on import, 0.1-0.2 s that no installed copy pays (`actscan profile` ÷ hand-written
    read 1.07× that way and 1.03-1.05× with the sources compiled, 2026-12-06). Once a
    process: the later sections find the files written."""
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", str(ROOT / "actscan"), str(ROOT / "benchmarks")],
        check=True,
        capture_output=True,
    )


def bench_help(reps: int) -> dict[str, Any]:
    compile_sources()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        subprocess.run([*actscan_cmd(), "--help"], capture_output=True, check=True, cwd=ROOT)
        times.append(time.perf_counter() - t)
    probe = (
        "import sys\nsys.argv = ['actscan', '--help']\nfrom actscan.cli import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print('IMPORTED', sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout
    imported = out.rsplit("IMPORTED", 1)[-1].strip()
    return {"samples": times, "median": statistics.median(times), "heavy_imports": imported}


def bench_e2e(device: str, reps: int, threads: int | None) -> dict[str, Any]:
    compile_sources()
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    cmds = {
        "profile": [
            *actscan_cmd(),
            "profile",
            "configs/gpt2-124m.yaml",
            "--quiet",
            "--fail-on",
            "never",
            "--device",
            device,
        ],
        "handwritten": [
            sys.executable,
            str(ROOT / "benchmarks" / "handwritten_gpt2.py"),
            "--device",
            device,
        ],
    }
    samples: dict[str, list[float]] = {k: [] for k in cmds}
    cpu: dict[str, list[float]] = {k: [] for k in cmds}
    for r in range(reps):
        order = list(cmds) if r % 2 == 0 else list(cmds)[::-1]
        for k in order:
            t, c = time.perf_counter(), children_cpu()
            subprocess.run(cmds[k], capture_output=True, check=True, cwd=ROOT, env=env)
            samples[k].append(time.perf_counter() - t)
            cpu[k].append(children_cpu() - c)
    med = {k: statistics.median(v) for k, v in samples.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    return {
        "samples": samples,
        "cpu": cpu,
        "median": med,
        "median_cpu": med_cpu,
        "ratio": med["profile"] / med["handwritten"],
        "ratio_cpu": med_cpu["profile"] / med_cpu["handwritten"],
    }


class OptimizerSteps:
    """N AdamW steps of a 12 × 768 model: by hand, and as `scan(steps=N)` measures them."""

    def __init__(self, device: str, n: int, batch: int, seq: int) -> None:
        import torch

        from actscan.layout.detect import detect_layout
        from actscan.measure.inputs import token_source

        self.model, _ = build("12x768", device)
        self.model.train()
        self.device, self.n = device, n
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.saved = [p.detach().clone() for p in self.params]
        vocab = self.model.config.vocab_size
        src = token_source(vocab, batch, seq, seed=0)
        self.source = lambda i: src(i).to(torch.device(device))
        self.layout = detect_layout(self.model, "actscan-gpt")

    def reset(self) -> None:
        import torch

        with torch.no_grad():
            for p, v in zip(self.params, self.saved, strict=True):
                p.copy_(v)
                p.grad = None

    def plain(self) -> None:
        import torch

        from actscan.measure.inputs import next_token_loss

        self.step_times: list[tuple[float, float, int]] = []
        opt = torch.optim.AdamW(self.params, lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
        for t in range(self.n):
            with step_clock(self.step_times, self.device):
                x = self.source(t).args[0]
                loss = next_token_loss(self.model(x), x)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
        with torch.no_grad():
            x = self.source(self.n).args[0]
            float(next_token_loss(self.model(x), x))  # the final loss, as the scan reports

    def instrumented(self) -> None:
        """The steps as `scan(steps=N)` takes them: inside the caller-state copy kept for
        the restore (its W_0; the restore included), from the pass's batch-0 gradients.
        Each t's step (`_Loop.step`: probe, batch, update, host read) is clocked."""
        import contextlib

        import torch

        import actscan.steps.loop as loop
        from actscan.measure.inputs import default_loss
        from actscan.measure.state import caller_state

        loss_of = default_loss("causal-lm", self.model.config.vocab_size)
        self.step_times = []
        step = loop._Loop.step

        def clocked_step(lp: Any, t: int, step0: Any) -> None:
            with step_clock(self.step_times, self.device):
                step(lp, t, step0)

        loop._Loop.step = clocked_step  # type: ignore[method-assign,assignment]
        try:
            with caller_state(self.model) as kept:
                b = self.source(0)
                loss = loss_of(self.model(*b.args), b)  # the profile's batch 0 (hooks aside)
                grads = list(torch.autograd.grad(loss, self.params, allow_unused=True))
                loop.run_steps(
                    self.model,
                    loop.StepSpec(self.n),
                    layout=self.layout,
                    source=self.source,
                    step0=(loss.detach(), grads),
                    loss_of=loss_of,
                    prepare=lambda x: x,
                    autocast=contextlib.nullcontext,
                    vocab_size=self.model.config.vocab_size,
                    w0=kept,
                )
                del grads
        finally:
            loop._Loop.step = step  # type: ignore[method-assign]


# A step at steady state: t = 0 allocates the optimizer's state and t = 1 first fills the
# run's peak memory (on a VM that hands freed pages back to its host, a fresh page costs
# ~10 µs); the whole run's figure has both.
STEADY_FROM = 2


@contextlib.contextmanager
def step_clock(into: list[tuple[float, float, int]], device: str) -> Iterator[None]:
    """Append (wall s, CPU s, minor page faults) of the block to `into`."""
    sync(device)
    w, c = time.perf_counter(), time.process_time()
    f = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    try:
        yield
    finally:
        sync(device)
        into.append(
            (
                time.perf_counter() - w,
                time.process_time() - c,
                resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f,
            )
        )


def bench_steps(device: str, reps: int, n: int, batch: int, seq: int) -> dict[str, Any]:
    """Interleaved (plain, instrumented) runs of N steps, weights reset between (untimed):
    the whole runs, and each run's steps t ≥ `STEADY_FROM` one by one."""
    st = OptimizerSteps(device, n, batch, seq)
    fns = {"plain": st.plain, "instrumented": st.instrumented}
    for fn in fns.values():  # warm-up
        fn()
        st.reset()
    samples: dict[str, dict[str, list[float]]] = {k: {"wall": [], "cpu": []} for k in fns}
    per_step: dict[str, list[list[tuple[float, float, int]]]] = {k: [] for k in fns}
    for r in range(reps):
        order = ("plain", "instrumented") if r % 2 == 0 else ("instrumented", "plain")
        for k in order:
            w, c = time_once(fns[k], device)
            per_step[k].append(list(st.step_times))
            st.reset()
            samples[k]["wall"].append(w)
            samples[k]["cpu"].append(c)
    med = {k: {m: statistics.median(v) for m, v in s.items()} for k, s in samples.items()}
    pairs = [
        i / p
        for i, p in zip(samples["instrumented"]["wall"], samples["plain"]["wall"], strict=True)
    ]
    # steps t = STEADY_FROM .. N-1 of every run: plain step t is its batch's forward +
    # backward + AdamW; the recorder's step t is the probe + that + the update figures
    steady = {k: [x for run in runs for x in run[STEADY_FROM:n]] for k, runs in per_step.items()}
    fields = ("wall", "cpu", "faults")
    step_med = {
        k: {m: statistics.median(x[i] for x in v) if v else math.nan for i, m in enumerate(fields)}
        for k, v in steady.items()
    }
    return {
        "steps": n,
        "batch": batch,
        "seq_len": seq,
        "reps": reps,
        "samples": samples,
        "per_step": per_step,
        "median": med,
        "ratio": med["instrumented"]["wall"] / med["plain"]["wall"],
        "ratio_cpu": med["instrumented"]["cpu"] / med["plain"]["cpu"],
        "ratio_pairs_median": statistics.median(pairs),
        "steady_from": STEADY_FROM,
        "step_median": step_med,
        "ratio_step": step_med["instrumented"]["wall"] / step_med["plain"]["wall"],
        "ratio_step_cpu": step_med["instrumented"]["cpu"] / step_med["plain"]["cpu"],
    }


def bench_steps_e2e(
    device: str, reps: int, threads: int | None, n: int, batch: int, seq: int
) -> dict[str, Any]:
    compile_sources()
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    size = ["--batch", str(batch), "--seq-len", str(seq), "--device", device]
    cmds = {
        "profile": [
            *actscan_cmd(),
            "profile",
            "configs/gpt2-124m.yaml",
            "--quiet",
            "--fail-on",
            "never",
            "--steps",
            str(n),
            *size,
        ],
        "handwritten": [
            sys.executable,
            str(ROOT / "benchmarks" / "handwritten_gpt2.py"),
            "--steps",
            str(n),
            *size,
        ],
    }
    samples: dict[str, list[float]] = {k: [] for k in cmds}
    cpu: dict[str, list[float]] = {k: [] for k in cmds}
    for r in range(reps):
        order = list(cmds) if r % 2 == 0 else list(cmds)[::-1]
        for k in order:
            t, c = time.perf_counter(), children_cpu()
            subprocess.run(cmds[k], capture_output=True, check=True, cwd=ROOT, env=env)
            samples[k].append(time.perf_counter() - t)
            cpu[k].append(children_cpu() - c)
    med = {k: statistics.median(v) for k, v in samples.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    return {
        "steps": n,
        "batch": batch,
        "seq_len": seq,
        "samples": samples,
        "cpu": cpu,
        "median": med,
        "median_cpu": med_cpu,
        "ratio": med["profile"] / med["handwritten"],
        "ratio_cpu": med_cpu["profile"] / med_cpu["handwritten"],
        "once": step0_extras(device, batch, seq),
    }


def children_cpu() -> float:
    """User + system CPU seconds of the finished child processes so far."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def step0_extras(device: str, batch: int, seq: int) -> dict[str, float]:
    """What `profile` pays once before its step-0 pass, in CPU seconds (median of 3), on
    the 12 × 768 model: the probe pass (one batch-1 forward for the layout self-check and
    the at-init fan-in of every weight, then each norm's effective gain); and the copy of
    the caller's weights kept for the restore, with the copy back."""
    import torch

    from actscan.layout.detect import detect_layout
    from actscan.layout.probe import probe_pass
    from actscan.measure.inputs import token_source
    from actscan.measure.state import caller_state

    model, _ = build("12x768", device)
    model.train()
    src = token_source(model.config.vocab_size, batch, seq, seed=0)
    dev = torch.device(device)
    layout = detect_layout(model)

    def restore() -> None:
        with caller_state(model):
            pass

    fns = {
        "probe_pass": lambda: probe_pass(model, layout, src(0).to(dev), at_init=True),
        "weights_copy_restore": restore,
    }
    return {k: statistics.median(time_once(f, device)[1] for _ in range(3)) for k, f in fns.items()}


# -- report ---------------------------------------------------------------------------------
def machine(device: str) -> dict[str, Any]:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info: dict[str, Any] = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": device,
    }
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
    return info


def rows(res: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(measure, value, target, verdict) for the table."""
    out = []

    def add(key: str, value: float, shown: str) -> None:
        limit = TARGETS[key]
        ok = "ok" if value <= limit else f"MISSED by {value / limit - 1:.0%}"
        out.append((key, shown, f"≤ {limit:g}", ok))

    for name in MODELS:
        o = res.get(f"overhead {name}")
        if o:
            med = o["median"]
            shown = (
                f"{o['ratio']:.3f}×  ({med['plain']['wall']:.3f} s → "
                f"{med['instrumented']['wall']:.3f} s; per pair {o['ratio_pairs_median']:.3f}×; "
                f"cpu {o['ratio_cpu']:.3f}×; +{o['per_scan_s'] * 1000:.0f} ms per scan)"
            )
            add(f"overhead {name}", o["ratio"], shown)
    for name in MODELS:
        t = res.get(f"tokens {name}")
        if t:
            shown = (
                f"{t['ratio']:.3f}×  ({t['median']['off']:.3f} s → {t['median']['on']:.3f}"
                f" s; per pair {t['ratio_pairs_median']:.3f}×)"
            )
            add(f"per-token view {name}", t["ratio"], shown)
    if "rss" in res:
        r = res["rss"]
        shown = (
            f"{r['ratio']:.3f}×  ({r['plain']['peak_mb']:.0f} → "
            f"{r['instrumented']['peak_mb']:.0f} MB)"
        )
        add("peak RSS 12x768", r["ratio"], shown)
    if "batches" in res:
        b = res["batches"]
        shown = (
            f"{b['ratio']:.3f}×  ("
            + ", ".join(f"N={n}: {v:.0f} MB" for n, v in b["peak_mb"].items())
            + ")"
        )
        add("RSS batches 16 / 1", b["ratio"], shown)
    if "help" in res:
        h = res["help"]
        shown = f"{h['median']:.3f} s  (imports torch/transformers: {h['heavy_imports']})"
        add("actscan --help (s)", h["median"] + (1e9 if h["heavy_imports"] != "[]" else 0), shown)
    if "e2e" in res:
        e = res["e2e"]
        shown = (
            f"{e['ratio']:.3f}×  ({e['median']['handwritten']:.2f} s → "
            f"{e['median']['profile']:.2f} s)"
        )
        add("profile end-to-end", e["ratio"], shown)
    if "steps" in res:
        s = res["steps"]
        med = s["median"]
        shown = (
            f"{s['ratio']:.3f}×  ({s['steps']} steps, {s['batch']}×{s['seq_len']} tokens: "
            f"{med['plain']['wall']:.2f} s → {med['instrumented']['wall']:.2f} s; per pair "
            f"{s['ratio_pairs_median']:.3f}×; cpu {s['ratio_cpu']:.3f}×)"
        )
        add("optimizer step 12x768 (whole run)", s["ratio"], shown)
        m = s["step_median"]
        shown = (
            f"{s['ratio_step']:.3f}×  (steps t ≥ {s['steady_from']}: "
            f"{m['plain']['wall']:.2f} s → {m['instrumented']['wall']:.2f} s; "
            f"cpu {s['ratio_step_cpu']:.3f}×)"
        )
        add("optimizer step 12x768 (one step)", s["ratio_step"], shown)
    if "steps-e2e" in res:
        e = res["steps-e2e"]
        med = e["median"]
        once = ", ".join(f"{k} {v:.2f}" for k, v in e.get("once", {}).items())
        shown = (
            f"{e['ratio']:.3f}×  ({e['batch']}×{e['seq_len']} tokens: "
            f"{med['handwritten']:.2f} s → {med['profile']:.2f} s; cpu "
            f"{e['ratio_cpu']:.3f}×, {e['median_cpu']['handwritten']:.1f} → "
            f"{e['median_cpu']['profile']:.1f} s; paid once, cpu s: {once})"
        )
        add("profile --steps 10 end-to-end", e["ratio"], shown)
    if "attention" in res:
        a = res["attention"]
        shown = (
            f"{a['ratio']:.3f}×  ({a['median']['plain']:.3f} s → {a['median']['probed']:.3f} s; "
            f"per pair {a['ratio_pairs_median']:.3f}×; cpu {a['ratio_cpu']:.3f}×; "
            f"batch {a['batch']} × seq {a['seq_len']}, eager)"
        )
        add("attention probes 12x768", a["ratio"], shown)
    return out


def print_table(table: list[tuple[str, str, str, str]]) -> None:
    widths = [
        max(len(r[i]) for r in [("measure", "value", "target", ""), *table]) for i in range(4)
    ]
    for r in [("measure", "value", "target", "verdict"), *table]:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        sys.path.insert(0, str(ROOT))
        child(sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick",
        action="store_true",
        help="5 runs everywhere, 3 end-to-end pairs, N = 1, 16 only (~2 min)",
    )
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"subset of {SECTIONS}")
    ap.add_argument("--models", default=",".join(MODELS), help=f"overhead models: {list(MODELS)}")
    ap.add_argument("--reps", type=int, default=None, help="timed runs per side (≥ 5)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON results")
    ap.add_argument("--step-batch", type=int, default=4, help="sequences per step (steps*)")
    ap.add_argument("--step-seq", type=int, default=64, help="tokens per sequence (steps*)")
    ap.add_argument("--step-n", type=int, default=5, help="optimizer steps per run (steps)")
    ap.add_argument("--attn-batch", type=int, default=2, help="attention section's batch [2]")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    reps = max(5, args.reps or (5 if args.quick else 7))
    t0 = time.perf_counter()
    res: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": machine(args.device),
        "load_before": os.getloadavg(),
        "args": vars(args) | {"out": str(args.out)},
    }
    # Processes first: a child's ru_maxrss starts from its parent's high-water mark at
    # exec (Linux), so the parent must not have built a 124M model yet.
    if "rss" in only and not args.device.startswith("cuda"):
        print("peak RSS (2 processes) ...", flush=True)
        res["rss"] = bench_rss(args.device, args.threads)
    if "batches" in only and not args.device.startswith("cuda"):
        ns = (1, 16) if args.quick else (1, 4, 16)
        print(f"peak RSS of scan(batches=N), N = {ns} ...", flush=True)
        res["batches"] = bench_batches(args.device, args.threads, ns)
    if "help" in only:
        print("actscan --help ...", flush=True)
        res["help"] = bench_help(reps)
    if "overhead" in only:
        for name in [m.strip() for m in args.models.split(",") if m.strip() in MODELS]:
            big = name == "12x768"
            n = 5 if big and args.quick else reps if not big else max(5, reps - 2)
            print(f"overhead {name}: {n} interleaved pairs ...", flush=True)
            res[f"overhead {name}"] = bench_overhead(name, args.device, n, 1 if big else 2)
    if "tokens" in only:
        for name in [m.strip() for m in args.models.split(",") if m.strip() in MODELS]:
            big = name == "12x768"
            n = 5 if big and args.quick else reps if not big else max(5, reps - 2)
            print(f"per-token view {name}: {n} interleaved pairs ...", flush=True)
            res[f"tokens {name}"] = bench_tokens(name, args.device, n, 1 if big else 2)
    if "e2e" in only:
        n = 3 if args.quick else 5
        print(f"actscan profile vs hand-written: {n} interleaved pairs ...", flush=True)
        res["e2e"] = bench_e2e(args.device, n, args.threads)
    if "steps" in only:
        n = 3 if args.quick else 5
        print(f"{args.step_n} optimizer steps, instrumented vs by hand: {n} pairs ...", flush=True)
        res["steps"] = bench_steps(args.device, n, args.step_n, args.step_batch, args.step_seq)
    if "steps-e2e" in only:
        n = 3 if args.quick else 5
        print(f"profile --steps 10 vs a hand-written 10-step loop: {n} pairs ...", flush=True)
        res["steps-e2e"] = bench_steps_e2e(
            args.device, n, args.threads, 10, args.step_batch, args.step_seq
        )
    if "attention" in only:
        n = 5 if args.quick else reps
        print(f"attention probes on vs off: {n} interleaved pairs ...", flush=True)
        res["attention"] = bench_attention(args.device, n, args.attn_batch)
    finish(res, rows(res), args.out, args.device, t0)


def finish(
    res: dict[str, Any], table: list[Any], out: Path, device: str, t0: float, prefix: str = ""
) -> Path:
    """Keep the results as JSON under `out` and print the machine line and the table (one
    ending for every benchmark here, so their files and tables read alike)."""
    res["load_after"] = os.getloadavg()
    res["seconds"] = time.perf_counter() - t0
    res["table"] = [
        dict(zip(("measure", "value", "target", "verdict"), r, strict=True)) for r in table
    ]
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{prefix}{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(res, indent=1, default=str) + "\n")
    m = res["machine"]
    print(
        f"\n{m['cpu']} · {m['cores']} cores · torch {m['torch']} ({m['torch_threads']} "
        f"threads) · {device} · load {res['load_before'][0]:.1f} → "
        f"{res['load_after'][0]:.1f} · {res['seconds']:.0f} s"
        + (f" · {m['allocator']}" if "allocator" in m else "")
    )
    print_table(table)
    print(f"\nwritten {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    return path


if __name__ == "__main__":
    main()
