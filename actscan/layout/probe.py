"""The layout proof and the at-init usage: what they read of one forward, and which one.

* The layout proof (`proof.BlockWatch`): every block's stream in, writes and stream out
  (a strided sample of their rows: `proof.PROOF_ROWS`).
* At init only, the usage watch (`usage.watch_usage`): how each parameter enters the
  contraction calls (its real fan-in) and each norm's input shape, then each norm's
  effective gain from a probe of the module alone.

Both ride on the recorded pass's first forward (`PassProbe`, the default): its hooks are
already there, and no forward of its own is paid for (a separate forward of even a few
tokens reads every weight once: ~4 % of a 124M-parameter forward+backward on a CPU). Their
hooks only read, so the recorded pass computes what it computes without them.

`probe_pass` is the separate forward, for the runs the recorded pass cannot carry them
in: dropout on (a train-mode forward makes fresh tensors of the writes, which the data
flow cannot follow) and a rank of a distributed run (every rank proves the same sample).
It runs the first sample of batch 0, no gradients, eval mode, the run's autocast. When
that forward raises, the proof says so in a note and the usage falls back to its own
pass (`usage.measure_usage`, which retries with the full batch when a cut one fails).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from actscan.layout.detect import is_norm
from actscan.layout.proof import (
    BlockWatch,
    ProofResult,
    proof_failed,
    proof_result,
    read_blocks,
)
from actscan.layout.usage import Usage, first_batch_of_one, measure_usage, norm_gains, watch_usage
from actscan.measure.hooks import HookSet
from actscan.measure.inputs import Batch
from actscan.measure.state import eval_mode
from actscan.records import Layout

__all__ = ["PassProbe", "Probe", "probe_pass"]

Gains = dict[str, tuple[float, float]]


@dataclass(frozen=True)
class Probe:
    """What the probe pass found.

    proof: the layout with every block proven (or marked skipped) and the proofs.
    usage, gains: at init, how the forward used each parameter and each norm's effective
    gain (mean, std over channels); None when not at init or when measuring failed.
    notes: the proof's notes, then the usage's.
    """

    proof: ProofResult
    usage: Usage | None = None
    gains: Gains | None = None
    notes: tuple[str, ...] = ()


def probe_pass(
    model: nn.Module,
    layout: Layout,
    batch: Batch,
    *,
    at_init: bool,
    autocast: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
) -> Probe:
    """Prove `layout` and (at init) measure parameter usage in one forward of `batch`'s
    first sample (already on the run's device and dtype); `autocast()` wraps the forward.

    The model's modes are put back; its random generators advance as the model's own
    eval-mode forward advances them (the recorded batches that follow see the same stream
    as after a plain forward). Never raises for the model's errors: they become notes.
    """
    if not layout.blocks and not at_init:
        return Probe(ProofResult(layout, ()))
    args, kwargs = first_batch_of_one(batch.args, batch.kwargs)
    watch: BlockWatch | None = None
    read_usage: Callable[[], Usage] | None = None
    failed: Exception | None = None
    try:
        with eval_mode(model), HookSet() as hooks, torch.no_grad():
            if layout.blocks:
                watch = BlockWatch(model, layout.blocks).install(hooks)
            adds = watch.adds() if watch is not None else contextlib.nullcontext()
            with watch_usage(model, hooks) if at_init else contextlib.nullcontext(None) as reader:
                with autocast(), adds:
                    model(*args, **kwargs)
                read_usage = reader
    except Exception as err:  # neither reader may break a scan: each says so below
        failed = err
    proof = _proof(model, layout, watch, failed)
    if not at_init:
        return Probe(proof, notes=proof.notes)
    usage, gains, usage_notes = _at_init(model, batch, read_usage)
    return Probe(proof, usage, gains, (*proof.notes, *usage_notes))


class PassProbe:
    """The proof and (at init) the usage riding on the recorded pass: `watch()` around its
    first batch's forward (the batch of `batch` samples the recorder measures), then
    `layout()` reads the proof (one host transfer) and `probe()` has what was found."""

    def __init__(self, model: nn.Module, layout: Layout, *, at_init: bool, batch: int) -> None:
        self.model, self.detected, self.at_init, self.batch = model, layout, at_init, batch
        self._watch: BlockWatch | None = None
        self._read: Callable[[], Usage] | None = None
        self._probe: Probe | None = None

    @contextlib.contextmanager
    def watch(self) -> Iterator[None]:
        """The proof's hooks and the usage watch, for the forward inside (removed after)."""
        with HookSet() as hooks:
            if self.detected.blocks:
                self._watch = BlockWatch(self.model, self.detected.blocks).install(hooks)
            adds = self._watch.adds() if self._watch is not None else contextlib.nullcontext()
            if not self.at_init:
                with adds:
                    yield
                return
            with watch_usage(self.model, hooks, self.batch) as reader, adds:
                yield
            self._read = reader

    def layout(self) -> Layout:
        """The proven layout, after the pass."""
        return self.probe().proof.layout

    def probe(self) -> Probe:
        """What the pass showed (read once)."""
        if self._probe is None:
            if self._watch is None and self.detected.blocks:  # the watch never ran
                failed: Exception | None = RuntimeError("the recorded pass did not run")
            else:
                failed = None
            proof = _proof(self.model, self.detected, self._watch, failed)
            if not self.at_init:
                self._probe = Probe(proof, notes=proof.notes)
            else:
                usage, gains, notes = _at_init(self.model, None, self._read)
                self._probe = Probe(proof, usage, gains, (*proof.notes, *notes))
        return self._probe


def _proof(
    model: nn.Module, layout: Layout, watch: BlockWatch | None, failed: Exception | None
) -> ProofResult:
    if not layout.blocks:
        return ProofResult(layout, ())
    if failed is not None:
        return proof_failed(layout, failed)
    assert watch is not None
    try:
        blocks, roles = read_blocks(model, watch)
    except Exception as err:  # the proof must never break a scan: say so and go on
        return proof_failed(layout, err)
    return proof_result(layout, blocks, roles)


def _at_init(
    model: nn.Module, batch: Batch | None, read_usage: Callable[[], Usage] | None
) -> tuple[Usage | None, Gains | None, tuple[str, ...]]:
    """The usage (from the shared pass, else its own), the norms' gains, and notes."""
    if read_usage is not None:
        usage = read_usage()
    else:  # the shared pass raised: the usage pass on its own, in the run's mode
        try:
            if batch is None:
                raise RuntimeError("the recorded pass did not run")
            usage = measure_usage(model, batch.args, batch.kwargs)
        except Exception as err:  # the recorded pass reports the model's own error
            line = next((ln for ln in str(err).splitlines() if ln.strip()), type(err).__name__)
            note = f"init-scale: fan-in read from weight shapes (measuring pass failed: {line})"
            return None, None, (note,)
    structured = sorted(
        name for name, p in model.named_parameters() if name not in usage.uses and p.numel() > 1
    )
    structured = [s for s in structured if not _is_norm_param(model, s)]
    notes: tuple[str, ...] = ()
    if structured:
        shown = ", ".join(structured[:3]) + (
            f", … ({len(structured)})" if len(structured) > 3 else ""
        )
        notes = (
            f"init-scale: {len(structured)} parameters are not matmul/conv/embedding weights "
            f"(structured, not judged): {shown}",
        )
    return usage, norm_gains(model, usage.norm_inputs), notes


def _is_norm_param(model: nn.Module, pname: str) -> bool:
    mname = pname.rpartition(".")[0]
    mod = model.get_submodule(mname) if mname else model
    return is_norm(mod)
