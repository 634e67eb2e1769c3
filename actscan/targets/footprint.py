"""How much memory a run of a config-described model needs, and whether the machine has it.

Checked before anything is allocated: a config that says `n_layers: 1000000000` or
`d_model: 1000000` (a typo, a corrupt file, a hostile one) is refused in well under a
second with the estimate and what the machine has, instead of building for minutes and
ending in the allocator or the kernel's OOM killer. `--force` skips the refusal.

The parameter count is exact for a stack of identical layers and needs no formula per
family: the model is built twice on the meta device (no storage, no init), at depth 1 and
2, and the difference is one layer (`extrapolate`). So a 10⁹-layer config costs two
one-layer builds, whatever the family (built-in or any transformers class).

The estimate, in bytes, for N parameter and buffer elements and b bytes per element of
the run's dtype:

* the build: the model is built in fp32 on the host (4N);
* the run's copy: bN more where the run casts or moves it (another dtype, or cuda);
* gradients: bN with the backward pass;
* `--steps`: the caller's weights kept to put back (4N) and Adam's two moments (2bN);
* activations: kept for the backward pass, per layer about
  B·S·(12·d + 3·ff) + 3·B·H·S² elements, plus the logits B·S·V in the dtype and twice in
  fp32 (the loss and its gradient); forward only, two layers at a time.

A floor, not a bound: allocator slack and the recorder's statistics come on top, so a
refusal means the run cannot fit, and a run that passes may still be tight.
"""

from __future__ import annotations

import math
import os
import resource
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from actscan.errors import BadInputError

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "RunPlan",
    "Shape",
    "available",
    "check_fits",
    "elements",
    "estimate",
    "extrapolate",
    "safe_int",
]

_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp64": 8}
DEFAULT_SEQ = 64
GiB = 1 << 30


@dataclass(frozen=True)
class RunPlan:
    """What the run will do, as far as memory goes (from the run's settings)."""

    dtype: str | None = None  # None: fp32
    batch: int = 4
    seq_len: int | None = None  # None: min(64, the model's positions)
    backward: bool = True
    steps: int = 0
    optimizer: str = "adamw"
    device: str | None = "auto"
    force: bool = False  # --force: estimate, but never refuse

    @property
    def elem_bytes(self) -> int:
        return _BYTES.get(str(self.dtype or "fp32"), 4)


@dataclass(frozen=True)
class Shape:
    """What a config says about size: elements of parameters and buffers (`numel`) and
    the dimensions the activations scale with (None where the config does not say)."""

    numel: int
    n_layers: int
    d_model: int | None = None
    d_ff: int | None = None
    n_heads: int | None = None
    vocab: int | None = None
    max_positions: int | None = None


@dataclass(frozen=True)
class Estimate:
    """Bytes the run needs on the host and on the run's device (0 when it is the host)."""

    host: int
    device: int
    device_name: str
    parts: tuple[tuple[str, int], ...]  # (what, bytes), for the message


def extrapolate(build: Callable[[int], nn.Module], depth: int) -> int:
    """Parameter and buffer elements of the model `build(depth)` gives, from meta builds
    at depth 1 and 2 (tied tensors counted once): exact when the layers are alike."""
    import torch

    def count(d: int) -> int:
        with torch.device("meta"):
            return elements(build(d))

    if depth <= 2:
        return count(depth)
    one, two = count(1), count(2)
    return one + (depth - 1) * max(two - one, 0)


def elements(model: nn.Module) -> int:
    """Parameter and buffer elements of `model`, a tensor tied in two places once."""
    seen = {id(t): t.numel() for t in (*model.parameters(), *model.buffers())}
    return sum(seen.values())


def _on_device(plan: RunPlan) -> str:
    if plan.device == "cpu":
        return "cpu"
    if plan.device == "cuda":
        return "cuda"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def estimate(shape: Shape, plan: RunPlan) -> Estimate:
    """The bytes `plan` needs for a model of `shape` (module docstring: the terms)."""
    n, b = shape.numel, plan.elem_bytes
    where = _on_device(plan)
    parts: list[tuple[str, int]] = [("the fp32 build", 4 * n)]
    run: list[tuple[str, int]] = []
    if where == "cuda" or b != 4:
        run.append((f"its {plan.dtype or 'fp32'} copy on {where}", b * n))
    if plan.backward:
        run.append(("gradients", b * n))
    if plan.steps:
        moments = 2 * b * n if plan.optimizer in ("adam", "adamw") else 0
        run.append(("kept weights and optimizer state", 4 * n + moments))
    run.append(("activations", _activations(shape, plan)))
    on_run = sum(v for _, v in run)
    if where == "cuda":
        return Estimate(4 * n, on_run, "cuda", (*parts, *run))
    return Estimate(4 * n + on_run, 0, "cpu", (*parts, *run))


def _activations(shape: Shape, plan: RunPlan) -> int:
    seq = plan.seq_len or min(DEFAULT_SEQ, shape.max_positions or DEFAULT_SEQ)
    rows = plan.batch * seq
    d = shape.d_model or 0
    ff = shape.d_ff or 4 * d
    per_layer = rows * (12 * d + 3 * ff) + 3 * plan.batch * (shape.n_heads or 1) * seq * seq
    layers = shape.n_layers if plan.backward else min(shape.n_layers, 2)
    logits = rows * (shape.vocab or 0)
    return per_layer * layers * plan.elem_bytes + logits * (plan.elem_bytes + 8)


def available(device: str) -> int | None:
    """Bytes free for this process on `device` now (None: cannot tell). The host: the
    kernel's MemAvailable, capped by this process's cgroup and its address-space limit."""
    if device == "cuda":
        import torch

        try:
            return int(torch.cuda.mem_get_info()[0])
        except Exception:  # no driver, a busy device: nothing to compare against
            return None
    limits = [x for x in (_mem_available(), _cgroup_room(), _rlimit_room()) if x is not None]
    return min(limits) if limits else None


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def _read_int(path: str) -> int | None:
    try:
        with open(path, encoding="ascii") as fh:
            text = fh.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def _cgroup_room() -> int | None:
    """The cgroup v2 limit less its usage, where the process runs under one."""
    limit = _read_int("/sys/fs/cgroup/memory.max")
    used = _read_int("/sys/fs/cgroup/memory.current")
    return None if limit is None or used is None else max(limit - used, 0)


def _rlimit_room() -> int | None:
    """RLIMIT_AS less the address space already mapped (ulimit -v)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            size = next((ln for ln in fh if ln.startswith("VmSize:")), "")
        mapped = int(size.split()[1]) * 1024 if size else 0
    except (OSError, ValueError, IndexError):
        mapped = 0
    return max(soft - mapped, 0)


def _sci(n: int) -> str:
    """A count of any size in 3 digits (a config's ints have no upper bound)."""
    if n.bit_length() < 1000:
        return f"{n:.3g}"
    return f"1e+{int(n.bit_length() * math.log10(2))}"  # past float: the magnitude alone


def _gib(n: int) -> str:
    if n.bit_length() >= 1000:
        return f"{_sci(n // GiB)} GiB"
    g = n / GiB
    if g >= 1e5:
        return f"{g:.2e} GiB"
    if g >= 0.01:
        return f"{g:.3g} GiB"
    return f"{n / (1 << 20):.3g} MiB" if n >= 1 << 20 else f"{n / 1024:.3g} KiB"


def check_fits(shape: Shape, plan: RunPlan, where: str) -> Estimate:
    """The estimate; BadInputError (one line, exit 2) when it exceeds what the host or
    the run's device has free, unless `plan.force`."""
    est = estimate(shape, plan)
    if plan.force:
        return est
    for device, need in (("cpu", est.host), (est.device_name, est.device)):
        if not need:
            continue
        free = available(device)
        if free is None or need <= free:
            continue
        shown = ", ".join(f"{what} {_gib(v)}" for what, v in est.parts if v)
        dtype = plan.dtype or "fp32"
        params = _sci(shape.numel) if shape.numel >= 10**6 else str(shape.numel)
        raise BadInputError(
            f"{where}: this model needs about {_gib(need)} on {device} ({params} parameters "
            f"in {dtype}, batch {plan.batch}: {shown}) but {device} has {_gib(free)} "
            "available; make it smaller or pass --force to try anyway"
        )
    return est


def safe_int(value: object) -> int | None:
    """A positive int from a config field, else None (configs hold anything)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return int(value) if value > 0 else None
