"""Frozen records that cross module boundaries.

Nothing here imports torch: the CLI, the renderers and the report writers work on these
plain values, so `actscan --help` and report post-processing stay fast. Field names match
the JSON report of docs/report-format.md (schema_version 1) one to one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class Role(StrEnum):
    EMBED = "embed"
    STREAM = "stream"
    ATTN = "attn"
    MLP = "mlp"
    NORM = "norm"
    ACT = "act"
    HEAD = "head"
    OTHER = "other"


class Severity(StrEnum):
    INFO = "info"
    WARN = "warn"
    ERROR = "error"

    @property
    def rank(self) -> int:
        return _SEVERITY_RANK[self]


_SEVERITY_RANK = {Severity.INFO: 0, Severity.WARN: 1, Severity.ERROR: 2}


class FailOn(StrEnum):
    INFO = "info"
    WARN = "warn"
    ERROR = "error"
    NEVER = "never"

    def trips(self, severity: Severity) -> bool:
        """True when a finding of `severity` makes the run exit 1."""
        if self is FailOn.NEVER:
            return False
        return severity.rank >= Severity(self.value).rank


class DType(StrEnum):
    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"


class CheckId(StrEnum):
    SQRT_GROWTH = "sqrt-growth"
    EXP_GROWTH = "exp-growth"
    COLLAPSE = "collapse"
    DEAD_BRANCH = "dead-branch"
    DEAD_UNITS = "dead-units"
    OUTLIER_CHANNELS = "outlier-channels"
    OVERFLOW = "overflow"
    VANISHING_GRAD = "vanishing-grad"
    EXPLODING_GRAD = "exploding-grad"
    INIT_SCALE = "init-scale"
    LOGIT_SCALE = "logit-scale"


@dataclass(frozen=True)
class ModelInfo:
    """What the target resolver knows about the model it built."""

    source: str
    family: str
    n_params: int
    n_blocks: int = 0
    d_model: int | None = None
    vocab_size: int | None = None
    # At initialization (no trained weights): enables init-scale checks. Config targets,
    # module:callable targets and scan() on a module are at init unless told otherwise
    # (`scan(at_init=False)`); checkpoints and folders are not.
    at_init: bool = False
    # Kind of task the default loss serves: "causal-lm", "masked-lm"/"encoder", "custom".
    task: str = "custom"
    # Free-form architecture facts the checks may read (norm placement, branch scaling,
    # attention scale, init scheme, …). Keys are documented where they are produced.
    arch: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RunInfo:
    dtype: str = "fp32"
    amp: str | None = None
    device: str = "cpu"
    batch: int = 0
    seq_len: int = 0
    batches: int = 1
    seed: int = 0
    backward: bool = True
    init: str | None = None


@dataclass(frozen=True)
class LayerRecord:
    """Statistics of one module's output (first tensor of a tuple), merged over batches."""

    name: str
    type: str
    role: str
    block: int | None
    calls: int
    mean: float | None = None
    std: float | None = None
    rms: float | None = None
    max_abs: float | None = None
    zero_frac: float | None = None
    nonfinite: int = 0
    channel_max_ratio: float | None = None
    outlier_channels: tuple[int, ...] = ()
    grad_rms: float | None = None
    grad_norm: float | None = None
    param_grad_norm: float | None = None
    # Extensions beyond schema v1 (kept out of nothing: they are in the JSON too).
    numel: int = 0
    n_channels: int | None = None
    dead_channels: int | None = None  # channels whose max-abs is exactly 0 over all calls
    channel_median_max: float | None = None  # median over channels of per-channel max-abs
    order: int = -1  # first-call index in execution order (for "first module that …")


@dataclass(frozen=True)
class StreamPoint:
    """The residual stream at one depth: k = residual additions so far."""

    k: int
    block: int | None
    name: str
    rms: float | None
    grad_rms: float | None = None
    mean: float | None = None
    std: float | None = None
    max_abs: float | None = None


@dataclass(frozen=True)
class BranchRecord:
    """One residual branch (attention or MLP output) against the stream it writes into."""

    block: int
    kind: str  # "attn" | "mlp"
    name: str
    rms: float | None
    stream_rms: float | None  # RMS of the stream entering the block
    ratio: float | None  # rms / stream_rms
    max_abs: float | None
    channel_max_ratio: float | None
    grad_rms: float | None
    param_grad_norm: float | None  # over all parameters inside the branch


@dataclass(frozen=True)
class ParamRecord:
    """Statistics of one parameter tensor (for init-scale checks), taken before the run."""

    name: str
    module: str
    role: str
    block: int | None
    shape: tuple[int, ...]
    mean: float
    std: float
    fan_in: int | None
    fan_out: int | None
    # "weight" (matrix), "embedding", "norm-gain", "bias", "scalar", "other"; at init (fan-in
    # measured in a forward pass) "structured": never a matmul/conv weight (A_log, D, …).
    kind: str
    nonfinite: int = 0
    # Norm gains at init: mean/std over channels of the gain measured by a probe (Gemma's
    # (1 + w) norms have gain 1 at w = 0); None: read from the weight.
    gain: float | None = None
    gain_std: float | None = None


@dataclass(frozen=True)
class Finding:
    check: str
    severity: Severity
    layers: tuple[str, ...]
    value: float | None
    threshold: float | None
    message: str
    hint: str = ""


@dataclass(frozen=True)
class BlockInfo:
    index: int
    name: str
    attn: str | None = None  # module whose output is the attention branch
    mlp: str | None = None  # module whose output is the MLP branch
    adds: int = 2  # residual additions this block makes (branches)


@dataclass(frozen=True)
class Layout:
    """Where the residual stream lives in a model."""

    blocks: tuple[BlockInfo, ...] = ()
    embed: str | None = None
    head: str | None = None
    final_norm: str | None = None
    container: str | None = None  # the ModuleList that holds the blocks
    roles: dict[str, str] = field(default_factory=dict)  # module name → Role value
    block_of: dict[str, int] = field(default_factory=dict)  # module name → block index
    note: str | None = None  # e.g. why no blocks were found

    def role(self, name: str) -> str:
        return self.roles.get(name, Role.OTHER.value)
