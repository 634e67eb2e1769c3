"""Frozen records that cross module boundaries.

Nothing here imports torch: the CLI, the renderers and the report writers work on these
plain values, so `actscan --help` and report post-processing stay fast. Field names match
the JSON report of docs/report-format.md (schema_version 1) one to one.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from enum import StrEnum
from typing import Any, TypeGuard

# -- how a field is written in JSON, where its type alone does not say it ---------------
JSON_META = "json"  # the dataclass field metadata key actscan.report.codec reads


@dataclass(frozen=True)
class JsonAs:
    """The JSON form of one record field, when it is not the plain one its type gives.

    The report codec (actscan.report.codec) writes every field from its type hint; these
    are the few shapes the report format chose otherwise, declared on the field itself so
    the codec has no per-record code.
    """

    name: str | None = None  # the JSON key, when it is not the field's name
    keys: tuple[str, ...] = ()  # a tuple of pairs, written as objects with these keys
    mapping: bool = False  # a tuple of (key, value) pairs, written as one object
    empty_null: bool = False  # an empty tuple is written as null
    omit_none: bool = False  # None leaves the key out of the object
    skip: bool = False  # not part of the JSON at all


def json_as(**shape: Any) -> dict[str, JsonAs]:
    """Field metadata: `field(default=(), metadata=json_as(keys=("k", "rms")))`."""
    return {JSON_META: JsonAs(**shape)}


class Role(StrEnum):
    EMBED = "embed"
    STREAM = "stream"
    ATTN = "attn"
    MLP = "mlp"  # MoE blocks (router + experts) are MLP branches too
    MIXER = "mixer"  # state-space sequence mixers (Mamba, Mamba2, Jamba's mamba layers)
    CROSS_ATTN = "cross_attn"
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
    """Every check id, in the one check order (see CHECK_ORDER)."""

    OVERFLOW = "overflow"
    UNDERFLOW = "underflow"
    EXP_GROWTH = "exp-growth"
    COLLAPSE = "collapse"
    SQRT_GROWTH = "sqrt-growth"
    VANISHING_GRAD = "vanishing-grad"
    EXPLODING_GRAD = "exploding-grad"
    DEAD_BRANCH = "dead-branch"
    DEAD_UNITS = "dead-units"
    OUTLIER_CHANNELS = "outlier-channels"
    MASSIVE_ACTIVATIONS = "massive-activations"
    LOGIT_SCALE = "logit-scale"
    ATTN_ENTROPY = "attn-entropy"
    INIT_SCALE = "init-scale"
    LOW_PRECISION = "low-precision"  # --formats: GEMMs that lose too much in FP8/MXFP8/NVFP4
    # the first optimizer steps (`--steps N`; actscan/diagnose/steps.py)
    UPDATE_SIZE = "update-size"
    AMPLIFICATION = "amplification"
    ATTN_LOGIT_GROWTH = "attn-logit-growth"
    LOGIT_DRIFT = "logit-drift"
    ADAM_EPSILON = "adam-epsilon"
    # Judged across the rows of a width sweep with steps (actscan/diagnose/coord.py), not
    # per report: not in the per-report registry (SWEEP_CHECKS).
    COORD_CHECK = "coord-check"


# Findings of equal severity are listed in this order everywhere (run_checks, the findings
# panel, Markdown, JUnit cases): numerics make everything else moot, measured depth
# pathologies explain most others, static init observations come last.
CHECK_ORDER: tuple[CheckId, ...] = tuple(CheckId)
# Checks that judge a sweep's rows together, not one report: no per-report check emits them.
SWEEP_CHECKS: frozenset[CheckId] = frozenset({CheckId.COORD_CHECK})
_CHECK_RANK = {c.value: i for i, c in enumerate(CHECK_ORDER)}


def finding_order(f: Finding) -> tuple[int, int]:
    """Sort key: worst severity first, then CHECK_ORDER (unknown check ids last)."""
    return -Severity(f.severity).rank, _CHECK_RANK.get(str(f.check), len(_CHECK_RANK))


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
    # Module mode of the run: "train" (normalisation layers use batch statistics, as in
    # training); dropout-like modules and rates are off unless `dropout` is True.
    mode: str = "train"
    dropout: bool = False
    inputs: str | None = None  # what one batch holds, in words ("2 images 3×32×32")
    loss: str | None = None  # the objective whose gradients were measured, in words
    # Distributed runs (torchrun, --nproc): processes the batch was split over, and the
    # torch.distributed backend ("gloo", "nccl"); 1 and None for a one-process run.
    world_size: int = 1
    backend: str | None = None


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
    # fp16 runs only (None otherwise): fraction of output values that are nonzero but below
    # fp16's smallest normal 2^-14 (subnormal, or flushed to 0 by a cast to fp16), and of
    # output-gradient values below it (flushed to 0 included).
    underflow_frac: float | None = None
    grad_underflow_frac: float | None = None


@dataclass(frozen=True)
class TopValue:
    """One of the largest |x| at a stream point (the per-token view), merged over batches.

    token: position in the sequence; sequence: row of the batch; batch: which batch
    (0-based); channel: index along the last dimension. token_id / text: the input token
    there, when the inputs are token ids (text only for `--input` text files).
    """

    value: float  # signed
    token: int
    channel: int
    sequence: int | None = None
    batch: int = 0
    token_id: int | None = None
    text: str | None = None


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
    # The per-token view: the largest |x| with where they sit, and the median |x| (of a
    # strided sample of ≤ 4096 values per batch; median of the batches' medians).
    top_values: tuple[TopValue, ...] = ()
    median_abs: float | None = None
    # The relative gradient token by token: RMS over tokens of RMS(x_t)·RMS(∂L/∂x_t).
    # Equal to rms·grad_rms where tokens are alike; a token with x ≈ 0 behind a norm (a
    # zero-initialised class token) gets a huge ∂L/∂x_t that this view weighs by its |x_t|.
    token_grad_rel: float | None = None
    # The median over tokens of RMS(x_t)·RMS(∂L/∂x_t) (median of the batches' medians):
    # the typical token's relative gradient, which the few positions that collect most of
    # it (a long causal sequence's first positions) do not move.
    token_grad_median: float | None = None


@dataclass(frozen=True)
class StreamRecord:
    """One residual stream of a model that has several (an encoder-decoder's encoder and
    decoder): its points (k from 0 at its first block's input) and its own growth fit.
    The primary stream (the last, which feeds the head) is also the report's `stream`
    and `summary`."""

    name: str
    container: str | None
    primary: bool
    points: tuple[StreamPoint, ...]
    summary: Summary


@dataclass(frozen=True)
class BranchRecord:
    """One residual branch (attention or MLP output) against the stream it writes into."""

    block: int
    kind: str  # a branch Role value: "attn" | "mlp" | "mixer" | "cross_attn"
    name: str
    rms: float | None
    stream_rms: float | None  # RMS of the stream entering the block
    ratio: float | None  # rms / stream_rms
    max_abs: float | None
    channel_max_ratio: float | None
    grad_rms: float | None
    param_grad_norm: float | None  # over all parameters inside the branch
    # What the stream receives when it is not the branch's own output (a post-branch norm,
    # a gain module), as proven by the layout self-check; None when it is the branch itself.
    write: str | None = None
    write_rms: float | None = None
    write_ratio: float | None = None  # write_rms / stream_rms
    verified: bool | None = None  # layout self-check of the block: None when not run
    moe: bool = False  # the branch is a router + experts block


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
    # At init (usage measured): the weight's linear/conv output goes straight into a norm
    # (conv → BatchNorm, an L2 normalisation): the norm divides its scale out, whatever
    # the weight's std.
    normed: bool = False
    # At init: its product is read by sin/cos (random Fourier features): the std is a
    # frequency scale, and the output is bounded whatever it is.
    periodic: bool = False
    # At init: the operand it multiplies has unit L2 norm over the contraction (normalised
    # rows), so its output's std is the weight's own: the fan-in rule is std 1.
    unit_input: bool = False


@dataclass(frozen=True)
class Skip:
    """A check that did not run, and why (the report lists it: silence is not a pass)."""

    check: str
    reason: str


@dataclass(frozen=True)
class Finding:
    check: str
    severity: Severity
    layers: tuple[str, ...]
    value: float | None
    threshold: float | None
    message: str
    hint: str = ""


@dataclass(frozen=True, eq=False)
class Summary(Mapping[str, Any]):
    """Whole-model figures of the residual stream (the report's "summary").

    Typed fields for the code; read-only mapping access (`summary["growth"]`, `.get`,
    `dict(summary)`) for users of the dict it replaces. Iterates in the JSON's key order.
    JSON spells a non-finite value "nan", "inf" or "-inf"; reading it back gives the float.
    """

    growth_exponent: float | None = None  # p in stream RMS ∝ k^p
    gain_per_block: float | None = None  # γ: geometric-mean RMS gain per block
    growth: float | None = None  # last stream RMS ÷ first
    var_intercept: float | None = None  # a in Var(x_k) ≈ a + b·k
    var_slope: float | None = None  # b
    grad_ratio: float | None = None  # grad RMS first ÷ last

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> Summary:
        """From a dict (a JSON report's "summary"); unknown keys are dropped, missing ones
        are None."""
        if isinstance(data, Summary):
            return data
        return cls(**{k: data[k] for k in _SUMMARY_KEYS if k in data})

    def __getitem__(self, key: str) -> Any:
        if key not in _SUMMARY_KEYS:
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(_SUMMARY_KEYS)

    def __len__(self) -> int:
        return len(_SUMMARY_KEYS)


_SUMMARY_KEYS = tuple(f.name for f in fields(Summary))


@dataclass(frozen=True)
class BranchInfo:
    """One residual branch of a block, by role, as the layout self-check proved it."""

    role: str  # Role value: "attn" | "mlp" | "mixer" | "cross_attn"
    name: str  # the branch module (its output is the branch's own output)
    write: str | None = None  # module whose output the stream receives, when not `name`
    moe: bool = False  # router + experts (an MLP branch)
    scale: float | None = None  # fitted coefficient when the stream receives scale·write


@dataclass(frozen=True)
class BlockProof:
    """The layout self-check of one block: x_in + Σ writes = x_out, measured.

    status: "verified" (the equation holds within `tolerance`), "unverified" (no set of
    candidate writes satisfies it: the block's branch checks are skipped) or "skipped" (the
    check could not run on this block, `note` says why).
    placement: "additive" (x_out = x_in + Σ writes), "post-norm" (the equation holds
    before the block's stream norms: x_out = norm(x_in + Σ writes), post-LN), "post-act"
    (the same at the input of the activation that makes x_out: relu(x_in + Σ writes),
    ResNet v1) or "plain" (no
    residual add: x_out is a chain of the block's modules applied to x_in; no branches).
    residual: ‖x_in + Σ writes − x_out‖ / (‖x_out − x_in‖ + ρ‖x_out‖), relative to the
    writes plus the rounding of the sum (per segment, the worst, for post-norm).
    stream: which block list the block belongs to ("main"; a second stream such as an
    encoder-decoder's decoder gets its own name).
    """

    block: int
    name: str
    status: str
    residual: float | None = None
    tolerance: float | None = None
    placement: str | None = None
    writes: tuple[str, ...] = ()
    roles: tuple[str, ...] = ()  # role of each write's branch
    norms: tuple[str, ...] = ()  # post-norm: the norms the stream passes through
    stream_scale: float | None = None  # fitted coefficient of the stream (DeepNorm α)
    stream: str = "main"
    note: str = ""
    # plain because the block's output has another shape than its input (a downsampling
    # stage): the stream's depth checks judge within the blocks between such changes
    reshaped: bool = False
    # False: the block never ran in the forward (a tower the inputs did not reach, a list
    # called through a method other than forward): nothing measured, nothing to prove
    ran: bool = True
    # False: the block's input is not the previous block's output (of its stream), nor a
    # view of it: a list of branches the model's own forward adds (XLM's `attentions`),
    # a residual quantizer's stages (each reads the residual x − q(x) the last one left)
    chained: bool = True
    # True: the model calls the block as block.forward(...), past every module hook (its
    # modules ran, its input and output were never seen): skipped with that reason
    bypassed: bool = False


@dataclass(frozen=True)
class BlockInfo:
    index: int
    name: str
    attn: str | None = None  # module whose output is the attention branch
    mlp: str | None = None  # module whose output is the MLP branch
    adds: int = 2  # residual additions this block makes (branches)
    # Every branch by role (set by the layout self-check; empty: attn/mlp above are a guess).
    branches: tuple[BranchInfo, ...] = ()
    proof: BlockProof | None = None
    # Which residual stream the block belongs to: "main", or the name of its block list
    # ("encoder", "decoder") when the model has several (see Layout.streams).
    stream: str = "main"

    def branch_list(self) -> tuple[BranchInfo, ...]:
        """The proven branches, else the guessed attention/MLP pair."""
        if self.branches:
            return self.branches
        return tuple(
            BranchInfo(role=role, name=name)
            for role, name in (("attn", self.attn), ("mlp", self.mlp))
            if name is not None
        )


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
    # (name, container) of each residual stream in execution order, when the model has
    # more than one (an encoder-decoder: encoder, decoder); empty: one stream, "main".
    # Block indices run on through the streams (decoder block 0 follows the encoder's).
    streams: tuple[tuple[str, str], ...] = ()

    def role(self, name: str) -> str:
        return self.roles.get(name, Role.OTHER.value)

    def stream_blocks(self) -> list[tuple[str, tuple[BlockInfo, ...]]]:
        """(stream name, its blocks) per residual stream, in execution order."""
        if not self.streams:
            return [("main", self.blocks)] if self.blocks else []
        return [
            (name, tuple(b for b in self.blocks if b.stream == name)) for name, _ in self.streams
        ]

    def block_label(self, index: int | None) -> str:
        """'block 3', or 'decoder block 1' (numbered within its stream) with several."""
        if index is None or not self.streams:
            return f"block {index}"
        for name, blocks in self.stream_blocks():
            if blocks and blocks[0].index <= index <= blocks[-1].index:
                return f"{name} block {index - blocks[0].index}"
        return f"block {index}"


# -- the first optimizer steps (`--steps N`) ---------------------------------------------


@dataclass(frozen=True)
class OptimizerInfo:
    """The optimizer the steps ran with (the report's `dynamics.optimizer`)."""

    name: str  # "adamw" | "adam" | "sgd"
    lr: float
    betas: tuple[float, float] | None = (0.9, 0.95)  # None for sgd
    eps: float | None = 1e-8  # None for sgd
    weight_decay: float = 0.0
    warmup: int = 0  # linear warmup steps (0: none)
    parametrization: str = "sp"  # "sp" | "mup": how learning rates were set per group


@dataclass(frozen=True)
class LogitStats:
    """The output logits on the probe batch: max, and log Z = logsumexp over the vocab."""

    max: float | None
    log_z_mean: float | None
    log_z_std: float | None


@dataclass(frozen=True)
class ChangeRecord:
    """One stream point or branch output on the fixed probe batch at step t.

    rel = ‖x_t − x_0‖ / ‖x_0‖ (0 at t = 0); abs_mean = mean |x_t|, delta_mean =
    mean |x_t − x_0| (the coordinate check's two curves).
    """

    name: str
    kind: str  # "stream" | a branch role ("attn", "mlp", …) | "head"
    k: int | None  # stream points: residual additions so far
    block: int | None  # branches: their block
    rel: float | None
    abs_mean: float | None = None
    delta_mean: float | None = None


@dataclass(frozen=True)
class StepRecord:
    """What step t measured (t = 0: before any update; the profile itself)."""

    t: int
    loss: float | None
    lr: float  # the learning rate the step after this measurement used (warmup applied)
    # (k, rms) of the step's batch
    stream: tuple[tuple[int, float | None], ...] = field(
        default=(), metadata=json_as(keys=("k", "rms"))
    )
    change: tuple[ChangeRecord, ...] = ()
    logits: LogitStats | None = None
    attn_max: float | None = None  # largest pre-softmax attention score, where recorded
    # (norm module, ‖g − 1‖ / √n)
    gain_drift: tuple[tuple[str, float], ...] = field(
        default=(), metadata=json_as(keys=("name", "drift"))
    )
    # (attention layer, its largest |pre-softmax score|) on the probe; attn_max is their max
    attn_layers: tuple[tuple[str, float | None], ...] = field(
        default=(), metadata=json_as(keys=("name", "max"))
    )
    # (stage, name) of every non-finite value step t met, in the order the step meets
    # them: "activation" (a probed output, forward order), "attention" (a layer's scores),
    # "loss", "gradient" (the update's, per parameter), "update" (W_{t+1}, per parameter);
    # empty when all were finite. NaN figures elsewhere are null: this says why.
    nonfinite: tuple[tuple[str, str], ...] = field(
        default=(), metadata=json_as(keys=("stage", "name"))
    )


@dataclass(frozen=True)
class UpdateRecord:
    """One parameter tensor over the steps: ratio[t-1] = ‖W_t − W_{t−1}‖ / ‖W_{t−1}‖ for
    t = 1..N; grad_rms[t] for t = 0..N-1 (the gradient each update used)."""

    param: str
    block: int | None
    role: str
    kind: str  # ParamRecord.kind: "weight", "embedding", "norm-gain", "bias", …
    ratio: tuple[float | None, ...]
    grad_rms: tuple[float | None, ...]
    numel: int = 0
    # drift[t-1] = ‖W_t − W_0‖ / ‖W_0‖ for t = 1..N: the cumulative movement, which weights
    # that grow with their updates cannot hide as they hide a per-step ratio (empty: not
    # recorded; None where ‖W_0‖ = 0)
    drift: tuple[float | None, ...] = ()
    # step_rms[t-1] = ‖W_t − W_{t−1}‖ / √numel for t = 1..N: the update per coordinate;
    # ÷ that step's lr it is Adam's |m̂/(√v̂ + eps)|, ≈ 0.1–1 while the gradient is above eps
    step_rms: tuple[float | None, ...] = ()


@dataclass(frozen=True)
class BlockUpdates:
    """The update ratios of one block's matrices of one role (embedding and weight
    tensors; biases and norm gains apart), over every step: the updates table's row."""

    block: int | None
    role: str
    params: int  # parameter tensors in the group
    ratio_median: float | None  # median over steps and tensors
    ratio_max: float | None
    grad_rms_median: float | None


@dataclass(frozen=True)
class Dynamics:
    """The first optimizer steps: the report's `dynamics` (absent when steps = 0)."""

    optimizer: OptimizerInfo
    # what the probe batch holds, in words; keyword-only, declared here for the JSON's order
    probe: str | None = field(default=None, kw_only=True)
    steps: tuple[StepRecord, ...]
    updates: tuple[UpdateRecord, ...] = ()
    # derived from `updates` (block_updates below)
    blocks: tuple[BlockUpdates, ...] = ()


# -- the first operation that breaks (`--trace`; actscan.measure.trace) -------------------


@dataclass(frozen=True)
class TraceInput:
    """One floating-point input of a traced operation: its largest finite |x| and its
    count of non-finite values."""

    dtype: str
    shape: tuple[int, ...]
    max_abs: float | None
    nonfinite: int = 0


@dataclass(frozen=True)
class TraceOp:
    """One aten operation of the traced pass: `index` in execution order (operations with
    a floating-point output), the module whose forward ran it ("" outside every module:
    the loss), forward or backward, its output's largest finite |x| and non-finite count,
    its inputs, and the caller's source line ("file:line in func", the code) that ran it
    (for a backward operation, the forward line whose gradient it computes)."""

    index: int
    op: str
    module: str
    phase: str  # "forward" | "backward"
    max_abs: float | None
    nonfinite: int = 0
    inputs: tuple[TraceInput, ...] = ()
    source: str | None = None
    code: str | None = None


@dataclass(frozen=True)
class TraceRecord:
    """One batch rerun under the dispatch-level trace (the report's `trace`): why it ran,
    at which step and batch, the precision judged and its largest value (None: fp32, only
    non-finite values count), how many operations it inspected, and the first operation
    out of range (None: none was), else `peak`, the one with the largest output."""

    reason: str  # "asked" | "overflow" | "non-finite" | "diverged"
    step: int
    batch: int
    dtype: str
    ceiling: float | None
    ops: int
    backward_ops: int = 0
    first: TraceOp | None = None
    peak: TraceOp | None = None


# -- attention probes (per attention layer, per head) ------------------------------------


@dataclass(frozen=True)
class HeadRecord:
    """One attention head, merged over batches and calls.

    score_max / score_std: the pre-softmax scores (after scaling, soft-capping and any
    additive position bias) over the allowed (query, key) pairs only. entropy: the mean
    over queries of H(p) / ln(allowed keys), 1 = uniform, 0 = all mass on one key
    (queries with one allowed key left out). sink: mean attention mass on key 0.
    """

    head: int
    score_max: float | None
    score_std: float | None
    entropy: float | None
    sink: float | None


@dataclass(frozen=True)
class AttentionRecord:
    """One attention layer (module) and its heads (the report's `attention[]`)."""

    name: str
    block: int | None
    heads: tuple[HeadRecord, ...]
    queries: int = 0  # query positions per sequence (the largest seen)
    keys: int = 0  # key positions per sequence (the largest seen)
    mean_keys: float | None = None  # allowed keys per query, averaged over the judged queries
    kv_heads: int | None = None  # key/value heads (< heads: GQA, 1: MQA)
    kind: str = "self"  # "self" | "cross"
    calls: int = 0
    softcap: float | None = None  # tanh soft-cap the scores passed through (Gemma 2: 50)
    sliding_window: int | None = None  # the layer's local window, when it has one
    stream: str | None = None  # the residual stream it belongs to, when there are several
    # the query/key rows' L2 norm (per head vector) when every row has the same one (a
    # norm on q/k: QK-norm), None when they spread or were not measured; the scale on q·kᵀ
    q_norm: float | None = None
    k_norm: float | None = None
    scaling: float | None = None
    head_dim: int | None = None  # the q/k vectors' width, when measured


# -- low-precision readiness (`--formats`; actscan/measure/lowprec.py) ---------------------


@dataclass(frozen=True)
class LowPrecRecord:
    """One GEMM operand cast in one format, over every call of the pass (the report's
    `low_precision[]`). underflow: the fraction of nonzero values the cast flushes to 0;
    saturation: of those, the fraction it clamps to the format's max; error: the relative
    quantization error ‖Q(x) − x‖² / ‖x‖²; range_worst / range_mean: over the scale
    blocks (the whole tensor for a per-tensor scale), log2(block amax / the block's
    smallest nonzero |x|), its worst block and its mean, in bits."""

    gemm: str  # the module; `path:op#i` when it runs several; SDPA's: `path.sdpa.qk|pv`
    op: str  # linear | matmul | mm | bmm | addmm | baddbmm | einsum | grouped_mm | sdpa
    operand: str  # input | weight | grad (the output gradient) | lhs | rhs | q | k | probs | v
    format: str  # fp8 | mxfp8 | nvfp4
    element: str  # e4m3 | e5m2 | e2m1
    block_size: int  # values per scale (0: one per-tensor scale)
    block: int | None  # the residual block the GEMM is in (None: outside the blocks)
    values: int
    nonzero: int
    underflow: float | None
    saturation: float | None
    error: float | None
    range_worst: float | None
    range_mean: float | None
    calls: int = 0
    # --gemm-error: ‖Q(X)Q(W)ᵀ − XWᵀ‖ / ‖XWᵀ‖ of the forward GEMM in this format, the same
    # on each of its operand rows (None: off, or a call it cannot redo)
    gemm_error: float | None = None
    # fp8 over `--steps`, delayed scaling (the scale from the previous steps' amax history):
    # the figures of steps 1..N's casts, whether the amax grew past the history, the steps
    delayed_underflow: float | None = None
    delayed_saturation: float | None = None
    delayed_error: float | None = None
    amax_grew: bool | None = None
    steps: int = 0


# -- pure figures derived from records (measure, steps and diagnose share them) ----------


def all_points(
    stream: Sequence[StreamPoint], streams: Sequence[StreamRecord]
) -> tuple[StreamPoint, ...]:
    """Every stream's points (the one stream when there is one)."""
    return tuple(p for s in streams for p in s.points) if streams else tuple(stream)


def _finite(x: float | None) -> TypeGuard[float]:
    return x is not None and math.isfinite(x)


def _finite_values(values: Sequence[float | None]) -> list[float]:
    return [v for v in values if v is not None and math.isfinite(v)]


def _linfit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float] | None:
    """Least squares y = c + s·x → (c, s)."""
    n = len(xs)
    if n < 2:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return None
    s = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return my - s * mx, s


@dataclass(frozen=True)
class GrowthFit:
    """How the stream's scale changes with depth.

    var_a, var_b: Var(x_k) ≈ a + b·k (the accumulator model; Var taken as mean(x²)).
    exponent p: RMS ∝ k^p over k ≥ 1 (√k growth gives p ≈ 0.5).
    gain γ: geometric per-block gain of the block outputs' RMS (γ^L is the total).
    growth: RMS of the last stream point over the first (k = 0).
    grad_ratio: activation-gradient RMS at the first block's input over the last block's output.
    """

    var_a: float | None = None
    var_b: float | None = None
    exponent: float | None = None
    gain: float | None = None
    growth: float | None = None
    grad_ratio: float | None = None
    n_points: int = 0

    def summary(self) -> Summary:
        """The report's `summary` of this fit."""
        return Summary(
            growth_exponent=self.exponent,
            gain_per_block=self.gain,
            growth=self.growth,
            var_intercept=self.var_a,
            var_slope=self.var_b,
            grad_ratio=self.grad_ratio,
        )


def growth_fit(stream: Sequence[StreamPoint]) -> GrowthFit:
    # (k, block, rms) of the points with a finite RMS
    pts = [(p.k, p.block, p.rms) for p in stream if _finite(p.rms)]
    if len(pts) < 2:
        return GrowthFit(n_points=len(pts))
    var = _linfit([k for k, _, _ in pts], [rms**2 for _, _, rms in pts])
    pos = [(k, b, rms) for k, b, rms in pts if k >= 1 and rms and rms > 0]
    p_fit = _linfit([math.log(k) for k, _, _ in pos], [math.log(rms) for _, _, rms in pos])
    blocks = [(b, rms) for _, b, rms in pos if b is not None]
    g_fit = _linfit([b for b, _ in blocks], [math.log(rms) for _, rms in blocks])
    first, last = pts[0][2], pts[-1][2]
    growth = last / first if first else None
    grads = [p.grad_rms for p in stream if _finite(p.grad_rms)]
    grad_ratio = None
    if len(grads) >= 2 and grads[-1]:
        grad_ratio = grads[0] / grads[-1]
    return GrowthFit(
        var_a=var[0] if var else None,
        var_b=var[1] if var else None,
        exponent=p_fit[1] if p_fit and len(pos) >= 2 else None,
        gain=math.exp(g_fit[1]) if g_fit else None,
        growth=growth,
        grad_ratio=grad_ratio,
        n_points=len(pts),
    )


def branch_records(
    layout: Layout, layers: Sequence[LayerRecord], stream: Sequence[StreamPoint]
) -> tuple[BranchRecord, ...]:
    """Attention/MLP branch outputs against the stream entering their block."""
    by_name = {r.name: r for r in layers}
    entering: dict[int, float | None] = {}
    # stream[0] enters block 0; stream[i] (output of block i-1) enters block i
    for i, b in enumerate(layout.blocks):
        entering[b.index] = stream[i].rms if i < len(stream) else None
    out: list[BranchRecord] = []
    for b in layout.blocks:
        verified = None if b.proof is None else b.proof.status == "verified"
        for br in b.branch_list():
            name = br.name
            if name not in by_name:
                continue
            rec = by_name[name]
            sq = [
                r.param_grad_norm**2
                for r in layers
                if (r.name == name or r.name.startswith(name + "."))
                and r.param_grad_norm is not None
            ]
            s_rms = entering.get(b.index)
            ratio = rec.rms / s_rms if rec.rms is not None and s_rms else None
            w = by_name.get(br.write) if br.write else None
            w_rms = None if w is None or w.rms is None else w.rms * abs(br.scale or 1.0)
            out.append(
                BranchRecord(
                    block=b.index,
                    kind=br.role,
                    name=name,
                    rms=rec.rms,
                    stream_rms=s_rms,
                    ratio=ratio,
                    max_abs=rec.max_abs,
                    channel_max_ratio=rec.channel_max_ratio,
                    grad_rms=rec.grad_rms,
                    param_grad_norm=math.sqrt(sum(sq)) if sq else None,
                    write=br.write,
                    write_rms=w_rms,
                    write_ratio=w_rms / s_rms if w_rms is not None and s_rms else None,
                    verified=verified,
                    moe=br.moe,
                )
            )
    return tuple(out)


def stream_branch_records(
    layout: Layout,
    layers: Sequence[LayerRecord],
    stream: Sequence[StreamPoint],
    streams: Sequence[StreamRecord] = (),
) -> tuple[BranchRecord, ...]:
    """Branch records, each against the stream entering its block in its own stream."""
    if not streams:
        return branch_records(layout, layers, stream)
    out: list[BranchRecord] = []
    for s in streams:
        blocks = tuple(b for b in layout.blocks if b.stream == s.name)
        out += branch_records(replace(layout, blocks=blocks), layers, s.points)
    return tuple(out)


# Parameter kinds whose update ratio the per-block table summarises: matrices. A bias or
# a norm gain starts at 0 or 1 and has its own scale (gain drift covers the gains).
MATRIX_KINDS = ("weight", "embedding")


def block_updates(updates: Sequence[UpdateRecord]) -> tuple[BlockUpdates, ...]:
    """Per (block, role), in first-seen order: the median and max update ratio over all
    steps and matrix tensors, and the median gradient RMS (`Dynamics.blocks`)."""
    groups: dict[tuple[int | None, str], list[UpdateRecord]] = {}
    for u in updates:
        if u.kind in MATRIX_KINDS:
            groups.setdefault((u.block, u.role), []).append(u)
    out = []
    for (block, role), members in groups.items():
        ratios = _finite_values([r for u in members for r in u.ratio])
        grads = _finite_values([g for u in members for g in u.grad_rms])
        out.append(
            BlockUpdates(
                block=block,
                role=role,
                params=len(members),
                ratio_median=statistics.median(ratios) if ratios else None,
                ratio_max=max(ratios) if ratios else None,
                grad_rms_median=statistics.median(grads) if grads else None,
            )
        )
    return tuple(out)
