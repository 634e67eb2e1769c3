"""Every threshold actscan uses, in one place, with the theory that sets its default.

Override with `--threshold NAME=VALUE`, a `thresholds` table in `[tool.actscan]`, or the
`thresholds=` argument of `scan()`. Names are kebab-case. Defaults were calibrated on the
matrix in tests/test_calibration.py (healthy configs quiet, planted pathologies loud); the
comment on each field gives the theory (docs/checks.md) and the measured margin.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace

from actscan.errors import UsageError


@dataclass(frozen=True)
class Thresholds:
    # ---- outlier-channels -------------------------------------------------------------
    # A channel whose max-abs is this many times the median channel's. Gaussian channels
    # differ by < 2× at these token counts; emergent LLM outlier features are tens to
    # hundreds of × the median, "massive activations" ~1000×. At 20× per-tensor int8
    # (s = max/127) leaves a typical value ≈ 127/20 ≈ 6 levels.
    outlier_ratio: float = 20.0
    # …and at least this many times the largest |x| a Gaussian with the tensor's own RMS
    # reaches over its n values, √(2 ln n)·RMS: a floor that scales with the tensor (an
    # absolute floor hides a ×100 channel of a std-0.02 init stream). A channel ×r above
    # the rest of a d-wide tensor reaches ≈ r/√(1 + r²/d) · √(ln(n/d)/ln n) × that maximum:
    # ×100 at d = 64 over 32 tokens ≈ 5.4; measured 4.0 (BERT) to 6.6 (Qwen2 d 128) at the
    # first layer it stands out in, across the family matrix (benchmarks/
    # calibrate_outliers.py). Healthy inits and the tiny trained GPT-2 reach ≤ 2.4 on any
    # layer (and none passes outlier-ratio). Limit: a tensor narrower than ~20 channels
    # with one channel dominating its RMS stays under the floor.
    outlier_gauss: float = 3.0
    # Optional absolute floor (LLM.int8()'s |x| ≥ 6 for trained, normalised hidden states):
    # 0 = off, as it depends on the model's scale; set 6 to reproduce LLM.int8().
    outlier_abs: float = 0.0
    # At stream points, a channel counts as an outlier only when it is large (> 6 × the
    # tensor's RMS) on at least this fraction of its tokens: a ×r channel across tokens is
    # there on ~40–75% of them, a massive activation on one token per sequence (1/T) —
    # that one is reported by massive-activations, per token. LLM.int8()'s outlier features
    # sit on ≥ 6% of the sequence dimensions; 10% keeps a first-token-only value at T ≥ 16
    # out.
    outlier_tokens: float = 0.1
    # error (models at init only: trained LLMs grow such channels on purpose) when per-tensor
    # int8 rounds a median-channel value to zero: ratio ≥ 2·127.
    outlier_ratio_error: float = 254.0

    # ---- massive-activations (Sun et al. 2024, "Massive Activations in LLMs") ---------------
    # A value at a stream point at least this many times the median |x| there …
    massive_ratio: float = 1000.0
    # … and at least this large: Sun et al.'s definition (|x| ≥ 100 and ≥ 1000× the median
    # magnitude); trained LLMs carry a few on the start token / delimiters.
    massive_abs: float = 100.0

    # ---- sqrt-growth (Var(x_k) ≈ a + b·k: the residual stream is an accumulator) -------
    # Fitted exponent of RMS ∝ k^p at or above which the stream is branch-dominated
    # (pure accumulation gives p = 0.5; a stream held by its embedding or by 1/√(2L)
    # branch scaling fits p ≤ 0.38 on every healthy config measured, naive stacks ≥ 0.47).
    sqrt_exponent: float = 0.4
    # Stream RMS growth from the first block's output to the last block's ("drift"):
    # ×4 = the variance of 16 unit branches on a unit stream, the √k drift of an unscaled
    # stack past ~16 blocks, where the "harmless at 6 layers" rule of thumb stops holding. Healthy
    # 1/√(2L) stacks drift ≤ ×3.0 (48 blocks), naive 48-block stacks ×5.4–8.7.
    growth_warn: float = 4.0
    # ×16 (variance ×256): √k accumulation needs ~256 unscaled blocks to get here.
    growth_error: float = 16.0
    # √k growth is what real families ship and train with: transformers' own init of
    # Llama, Mistral, Qwen2 (no 1/√(2L)) drifts ×4.7–15.4 at 12–48 blocks, at most
    # ×2.22·√L (Llama, 48 × 256), GPT-2 ≤ ×1.13·√L, Gemma ≤ ×0.57·√L; pure accumulation
    # of unit branches stays ≤ √L (benchmarks/calibrate_growth.py, docs/checks.md). Past
    # growth-warn the drift is info with its number; a warning needs more growth than
    # those inits give: drift ≥ this × √L (1.8× the largest measured).
    growth_excess: float = 4.0
    # A jump inside block 0: block 0's output RMS ÷ the embedding's (the stream's growth
    # measured from the embedding, which the drift above starts after). Real families'
    # own inits jump ≤ ×15.7 (Llama/Qwen2 at width 1024), a post-LN stack's first norm
    # ×35.7 (0.028 → 1); every weight at std 1 jumps ×5.8e3 (Llama, width 256).
    growth_jump: float = 100.0
    growth_jump_error: float = 1000.0
    # The stream checks (fits, gains: sqrt-growth, exp-growth, collapse) need this many
    # block outputs: a growth exponent or a per-block gain fitted on fewer points is noise.
    min_blocks: float = 4
    # The gradient checks compare two measured numbers, the relative gradient at the first
    # block's input and at the last block's output; no fit is involved, so 2 blocks (3
    # stream points) are enough: a ×10 trend over 2 blocks is ×3.2 per block, far outside
    # the ×1.3 any healthy stack shows end to end.
    grad_min_blocks: float = 2

    # ---- exp-growth / collapse (per-block gain γ compounds to γ^L) --------------------
    # γ^L above this (or below its inverse) is an order of magnitude across the stack; the
    # γ = 1.2 over L = 32 blocks reaches 1.2^32 ≈ 340×. √k accumulation through L blocks stays
    # ≤ √L (×7 at 48), so 10 does not confuse the two.
    exp_gain_warn: float = 10.0
    exp_gain_error: float = 100.0
    # Exponential growth keeps its pace through depth; √k growth slows down. Growth counts
    # as exponential when the second half of the stack grows (in log, per block) at least
    # this fraction of the first half's pace (√k over 48 blocks: 0.21; geometric: 1.0).
    exp_sustain: float = 0.5

    # ---- vanishing-grad / exploding-grad ------------------------------------------------
    # Ratio of the relative activation gradient r = RMS(∂L/∂x)·RMS(x) at the first block's
    # input vs the last block's output. r is invariant to the stream's scale (norms make
    # the loss scale-free, so ∂L/∂x ∝ 1/|x|): raw gradient RMS would false-alarm on every
    # pre-LN model with a small embedding. r stays within ×1.3 on every healthy stack
    # measured; an order of magnitude mirrors exp-gain-warn.
    grad_ratio_warn: float = 10.0
    grad_ratio_error: float = 100.0

    # ---- underflow (fp16 runs: --dtype fp16 or --amp fp16) ---------------------------------
    # Fraction of a module's output-gradient values below fp16's smallest normal 2^-14
    # (6.1e-5: subnormal, precision lost bit by bit, or flushed to 0) at the run's loss
    # scale 2^12 (GradScaler-like). Healthy configs measured: ≤ 5% (fused q/k/v), a 24-block
    # post-LN stack 20% at block 0; the head's logit gradients (≈ p/(tokens) each) and
    # masked attention scores are not judged. Losing half of a gradient is learning from
    # half its signal. Transformer Engine reports the same "underflows %".
    underflow_warn: float = 0.5
    # error when almost all of it is gone (≥ 90%): that part of the model gets no update.
    underflow_error: float = 0.9

    # ---- low-precision (--formats: FP8, MXFP8, NVFP4 casts of every GEMM operand) --------
    # Nonzero values a cast flushes to 0, beyond what the format flushes of a Gaussian
    # (fp8, mxfp8: none; nvfp4's E2M1 flushes ~7% of any well-scaled block): Transformer
    # Engine's default (its debug tools fall back to high precision above 5% underflows).
    # Judged for fp8 and mxfp8; NVFP4's flushed values are the smallest of their block and
    # carry little of its energy, so its error says more. Calibrated against simulated
    # low-precision trainings (benchmarks/calibrate_lowprec.py, 300 steps, 3 paired seeds,
    # docs/checks.md): 4 fp8 configurations flagged, 1 with a loss gap (P 0.25): info.
    lowprec_underflow: float = 0.05
    # Relative error ‖Q(x) − x‖²/‖x‖² at or above this many times the format's own on a
    # Gaussian (E4M3 per tensor 7.0e-4, E5M2 2.8e-3, MXFP8 8.6e-4, NVFP4 9.1e-3): the
    # scale no longer fits the values. Healthy transformers Llama / GPT-2 at init: ≤ 1.4×
    # on every GEMM operand. Not calibrated against training runs: info.
    lowprec_error_ratio: float = 10.0
    # fp8 under delayed scaling over --steps (the scale from the previous steps' amax):
    # values above the history's amax saturate. A fraction of an operand's nonzero values
    # at or above this saturates: its amax grew faster than the history follows. Healthy
    # tiny MLP at lr 1e-3: ≤ 0.33% (weights moving past their step-0 amax); an input growing
    # 4× a step: 32%. Not calibrated against training runs: info.
    lowprec_delayed_saturation: float = 0.01

    # ---- dead-branch -------------------------------------------------------------------
    # A branch whose output RMS (or output-gradient RMS) is below this fraction of the
    # stream's writes nothing that survives bf16 rounding (2^-8 ≈ 4e-3 relative): 1e-3 is
    # below half a bf16 ulp. Smallest healthy branch measured: post-LN attention at 0.02
    # init, 7e-3 of the stream.
    dead_branch_ratio: float = 1e-3
    # At init, when every branch of one kind is under dead-branch-ratio, those within this
    # factor of the kind's median are the init's own scale (info): a uniform small init
    # spreads ≤ ×1.2 across blocks (ModernBERT's MLPs at width 64: 6.7e-4 to 7.5e-4 of the
    # stream; 1.25e-2 at its real width 768), an accident (a zeroed or 1e-3-scaled
    # projection in one block) sits at 0 or orders of magnitude below its siblings.
    dead_branch_spread: float = 10.0

    # ---- dead-units ----------------------------------------------------------------------
    # Fraction of an activation layer's channels that are zero on every token. A ReLU with
    # centred pre-activations is zero on all N tokens with probability 2^-N (≈ 1e-77 at 256
    # tokens), so any real fraction means shifted pre-activations; 5% tolerates the few dead
    # units trained ReLU nets carry and units that fire only on tokens the batch lacks.
    dead_units_warn: float = 0.05
    # Half the layer's width gets no gradient and never recovers.
    dead_units_error: float = 0.5
    # A unit zero on all N rows fires on fewer than ~3/N of them (95 % bound), so with few
    # rows a rarely-firing unit looks dead: a healthy He-init 4-layer ReLU MLP shows 8 % of
    # its last layer "dead" over 32 rows, 1.6 % over 256, 0 over 1024 (T5's decoder ReLUs
    # 13 % over 32 tokens). Below this many rows per channel a warn is info, with the
    # number (an error, half the layer dead, stands); the default 4 × 64 batch has 256.
    # Deep narrow ReLU stacks stay ≥ 19 % dead at 256 and 2048 rows: a real effect, a warn.
    dead_units_min_rows: float = 256.0

    # ---- overflow ------------------------------------------------------------------------
    # Warn when max|x| is within this factor of the run dtype's largest finite value (fp16
    # 65504): ×16 is a few blocks of growth, or normal activation growth in training; fp16
    # values above 4096 already have an ulp of 4, and their squares overflow above 256.
    headroom: float = 16.0

    # ---- init-scale (models at initialization) --------------------------------------------
    # Weight std above this multiple of the fan-in rule √(1/fan_in): each such layer
    # multiplies variance by > 2.56 (1.6² ), beyond He's √(2/fan_in) (×1.41, compensating
    # ReLU's halving) — the largest classical rule. A flat 0.02 crosses it at fan_in > 6400
    # (the MLP down-projection of d_model 1600+).
    init_scale_high: float = 1.6
    # error at ×4 (variance ×16 per layer: 10 such layers compound to 1e12).
    init_scale_error: float = 4.0
    # info below this multiple of √(1/fan_in) (output projections excluded: they are
    # down-scaled on purpose): the layer passes on ≤ 0.25% of its input variance.
    init_scale_low: float = 0.05
    # Bias at init above this many standard deviations of the pre-activation it shifts
    # (std(W)·√fan_in for unit inputs): a −1σ shift leaves a ReLU unit active on 16% of
    # tokens; zero biases are the classical init.
    init_bias_sigma: float = 1.0
    # Norm gains off 1 (mean or spread) by more than this at init: the gain alone sets the
    # branch input scale.
    init_gain_tol: float = 0.1
    # Residual output projections not down-scaled: the 2L branches of a pre-norm stack add
    # 2L·s² unit branch variances (s = output/input projection std). Info at ≥ 16 (the
    # variance behind growth-warn's ×4); 1/√(2L) scaling makes it 1 at any depth.
    residual_budget: float = 16.0

    # ---- logit-scale ---------------------------------------------------------------------------
    # Logit std as a multiple of √(2 ln V): above it the softmax over V outcomes is
    # dominated by its top logit ("frozen": log Z ≈ max, not ln V + s²/2), so the initial
    # loss is far above ln V and the gradient goes to a few classes. Also used for attention
    # scores over T keys. Healthy heads at init: std ≤ 1 (V = 512: limit 3.5).
    logit_freeze: float = 1.0
    # error at init at 4× (loss at init ≳ 8 ln V, z-loss (log Z)² in the thousands).
    logit_freeze_error: float = 4.0
    # Largest pre-softmax attention score (attention probes). Gemma 2 bounds its scores
    # with a tanh soft-cap of 50 (attn_logit_softcapping): past 50 a score is beyond what a
    # production model lets through. At init, where scores are O(1) (healthy: max ≤ 1 on
    # every family measured), warn; in a checkpoint, info (MiniLM-L6's layer 0 reaches 54).
    attn_score_max: float = 50.0
    # Kimi K2's QK-Clip threshold τ = 100: MuonClip rescales W_q, W_k of any head whose max
    # logit passes 100, the attention-logit explosion that precedes loss spikes. error at
    # init, warn in a checkpoint.
    attn_score_max_error: float = 100.0

    # ---- attn-entropy ---------------------------------------------------------------------------
    # Normalised entropy e = H(p)/ln n of a head (n: allowed keys per query; the head
    # spreads over n^e keys). Gaussian scores of std σ give e ≈ 1 − σ²/(2 ln n): healthy
    # heads at init sit at ≥ 0.99 (σ ≲ 0.1 on every family measured); 0.5 is √n of n keys,
    # scores at 0.7× the freezing point √(2 ln n). Warn at init below it.
    attn_entropy_low: float = 0.5
    # Below 0.1 (1.5 of 64 keys) the head is collapsed onto one key: error at init; in a
    # checkpoint info (positional and sink heads do this on purpose: MiniLM-L6 has 2 of 72
    # on random tokens), warn when every head of a layer is collapsed.
    attn_entropy_collapse: float = 0.1

    # ---- the first optimizer steps (--steps N) -----------------------------------------
    # Set from training outcomes: docs/calibration-dynamics.md. The ground truth (real text,
    # five families, 300-step runs; fitted on its calibration half only, scored on the
    # held-out half) sets update-drift-warn, update-gain-drift-warn, attn-logit-*,
    # log-z-excess and the severity of adam-epsilon; the rest comes from the earlier
    # synthetic grid (128 tiny runs, 35 that failed to train; "P/R" = precision/recall of
    # the warn against failure; base rate 0.27).
    # update-size: the largest median (over the steps after the first) of a weight matrix's
    # ‖W_t − W_{t−1}‖/‖W_{t−1}‖. Adam moves each coordinate by ≈ lr, so a GPT-2-init
    # matrix (std 0.02) moves ≈ lr/0.02 of its norm per step. No run that trained reached
    # 0.19; 0.2 flags 13 runs, all failed (P 1.00, R 0.37): docs/calibration-dynamics.md,
    # "The earlier grid".
    update_ratio_warn: float = 0.2
    # error when a step moves a matrix by its whole norm: the weights are replaced every
    # step (by construction; the earlier grid's largest was 0.29,
    # docs/calibration-dynamics.md).
    update_ratio_error: float = 1.0
    # …or when the median matrix's cumulative movement ‖W_N − W_0‖/‖W_0‖ after the steps
    # reaches this (weights that grow with their updates keep the per-step ratio flat at
    # 0.14–0.20 from lr 3e-2 to 1.0; the cumulative movement does not). Ground truth
    # (docs/calibration-dynamics.md), calibration half (96 runs of the first round): runs
    # that trained ≤ 6.4, the next value 9.4 (a failing run); 7.8 is the geometric
    # midpoint (std-0.2 inits move less and are left to attn-logit-growth and
    # logit-drift). Refit on the 156 runs with the second round: the best-F1 cut that
    # flags no healthy best-lr run is 9.37, its midpoint 7.76: kept (one healthy run above
    # it, Qwen2 at 24 layers and lr 0.1, 0.42 nats off its best: inside the 0.5-nat label).
    update_drift_warn: float = 7.8
    # …or (Adam) when the median norm gain's cumulative movement ‖g_N − g_0‖/‖g_0‖ reaches
    # this. Gains start at 1 in every init, so their movement is Adam's Σ lr_t × the
    # update's coherence whatever the matrices' std: it sees the too-large lr of fan-in,
    # μP and std-0.2 inits whose matrices (std 0.09–0.2) move < 3.5× their norm. Ground
    # truth (docs/calibration-dynamics.md), calibration half (96 runs of the first round):
    # runs that trained ≤ 0.131, the failing runs above them from 0.184 (no false alarm,
    # R 0.97; the best-F1 cut, 0.127, sits inside the lr-3e-2 cluster at 0.10–0.13 where
    # healthy and failing runs interleave); 0.155 is the geometric midpoint. With the
    # second round (156 runs) the best-F1 cut is still 0.127 in that cluster; one healthy
    # run now sits above 0.155 (the Qwen2 L24 lr-0.1 run, 0.406): kept. In effect a cap
    # on lr × steps (≈ 4 × 0.04 over 10 steps): it cannot see an lr too large for a wider
    # model, which fails at lower lrs than the ground truth's widths (64–128) do.
    update_gain_drift_warn: float = 0.155
    # info: a matrix moving this many times the median matrix's ratio (1/√(2L)-scaled
    # projections sit at √(2L)×, ×7 at 24 layers; ×10 is beyond the usual depth scaling).
    # Set by that argument, not fitted: info only (docs/calibration-dynamics.md).
    update_outlier: float = 10.0
    # amplification (info only: it did not predict failure): after the first update, the
    # probe's change per block in the second half of the stack ÷ in the first half. Post-LN
    # grows linearly (0.91–1.11 measured), Pre-LN saturates (0.27–0.36) and Pre-LN with
    # 1/√(2L) rises like a logarithm (0.58–0.67), on the earlier grid's Post-LN and Pre-LN
    # stacks (docs/calibration-dynamics.md, which the ground truth does not cover).
    amplification_sustain: float = 0.8
    # …judged only while the first step changes the last block output by at most this
    # (relative): past it every curve saturates and flattens (Post-LN at lr ≥ 1e-2: 0.06–0.5).
    amplification_linear: float = 1.0
    # …on stacks of at least this many blocks: a Pre-LN change saturates within its first
    # ~6 blocks, so only a stack twice that deep shows the saturation in its second half
    # (at 6 blocks Pre-LN curves measured as straight as Post-LN ones: ratio 1.1–1.2).
    amplification_min_blocks: float = 12
    # attn-logit-growth: the largest pre-softmax attention score after the steps. Ground
    # truth (docs/calibration-dynamics.md), calibration half (96 runs): below the best
    # cut (191) the largest value was 116, a run that trained; 150 was the geometric
    # midpoint. Refit on the 198-run calibration half for the target the issue sets
    # (most unstable runs caught at precision ≥ 0.9, no healthy best-lr run flagged;
    # ceiling.py): the cut is 91.7 on the grown scores, the value below it 89.0, midpoint
    # 90.4 (90 shipped, inside the gap); chosen in 29 of 30 leave-one-configuration-out
    # folds, out of fold (with
    # logit-peak-warn) precision 0.92, recall 0.91. Healthy transformers Llama/Mistral/
    # Qwen2 at 12–32 layers reach ≤ 5 in 10 steps at lr 1e-3 (benchmarks/healthy_inits.py);
    # the synthetic grid's healthy real families 10–25 at lr 1e-2.
    attn_logit_warn: float = 90.0
    # …having grown at least this many times since step 0 (scores large by construction,
    # QK-norm's ~4 or a std-0.2 init's ~15–25, are not growth; the failing std-0.2 run
    # grew ×30, those of the families' own inits ×6000 and more).
    attn_logit_growth: float = 10.0
    # error past this (and grown as above): ~7× the warn level, set by judgement, not
    # fitted (the calibration half has one healthy run above 150). Past it, scores large
    # from the start that did not grow are info.
    attn_logit_cap: float = 1000.0
    # logit-drift: the largest |log Z_t − log Z_0| over the steps, in nats, reported (info)
    # from this drift on. On the synthetic grid's random tokens ≥ 0.4 flagged 29 runs, 25
    # failed; on real text healthy runs drift further as they learn, so the warning is
    # judged against the loss (log-z-excess). docs/calibration-dynamics.md has both grids.
    log_z_drift: float = 0.4
    # …a warning only when log Z moved this much more than the loss fell,
    # max_t |log Z_t − log Z_0| − max(0, loss_0 − loss_t): on real text log Z rises as the
    # model learns a peaked distribution (drifts of 0.5–2.5 nats in 10 healthy steps).
    # Ground truth (docs/calibration-dynamics.md), calibration half (96 runs of the first
    # round): runs that trained ≤ 6.0 nats beyond the loss's fall, failing runs from 6.8
    # (P 1.00, R 0.88); 6.4 is the geometric midpoint. Refit on 156 runs: best-F1 cut 6.73,
    # midpoint 6.36: kept (the one healthy run above, the Qwen2 L24 lr-0.1 run, at 8.43).
    # Refit on the 198-run calibration half with the third round, whose μP curve at the
    # base width (bf16, depth 4) trained at its best lr 7.83 nats beyond the loss (lr
    # 1e-2; 6.61 at 3e-2): best-F1 cut that flags no healthy best-lr run 7.90 (P 0.98,
    # R 0.63), the value below it 7.83, midpoint 7.87. Below it a drift ≥ log-z-drift is info.
    log_z_excess: float = 7.87
    # …or when, after an update, the largest logit stands this many nats above the mean
    # log Z (max_t max logit_t − mean log Z_t): a softmax's own normaliser is never below
    # its top logit, so this is how far a few positions' logits have run away from the
    # rest. Ground truth (docs/calibration-dynamics.md), 198-run calibration half:
    # picked with attn-logit-warn by ceiling.py (29 of 30 folds); healthy runs ≤ 9.91,
    # the cut 10.1; 10 is the midpoint. It catches diverging runs (from < 0 at step 0)
    # and the built-in μP model at its base width, whose init peak (9–21) small lrs had
    # not brought down and which spiked later. A warning only at init (the evidence's
    # runs all start there); for a checkpoint, info.
    logit_peak_warn: float = 10.0
    # adam-epsilon: gradient RMS ÷ eps at or below which Adam's update shrinks (the step is
    # g/(√v + eps): at ratio 10 it is 91 % of lr, at 1 half; by construction, scored in
    # docs/calibration-dynamics.md).
    adam_eps_ratio: float = 10.0
    # …warn when the tensors below it hold at least this share of the parameters (fewer:
    # info). A few QK-norm gains of a trained-fine run reached it (share < 1e-3); the runs
    # whose gradients collapsed had 0.1–92 % (P 1.00, R 0.43; docs/calibration-dynamics.md,
    # "The earlier grid").
    adam_eps_share: float = 0.001
    # …counting only tensors whose update collapsed: Adam's step per coordinate ÷ lr at
    # the last step ≤ this × the first step's (≈ 1: Adam's first step is lr·sign(g)); a
    # gradient at 3–7 × eps still moves ~80 % of lr. A gradient near eps without the
    # collapse is info: on the ground truth's calibration half (docs/calibration-dynamics.md)
    # it flagged 8 runs, 7 of
    # them failing (P 0.88, R 0.21), and no update collapsed in any run;
    # the collapse's warning rests on the synthetic grid's Post-LN runs below.
    adam_collapse: float = 0.1
    # ---- coord-check (`actscan sweep --width … --steps N`: μP's coordinate check) -------
    # Log–log slope of a module group's mean |x_t| (or mean |x_t − x_0|) against width
    # above which it grows with width. Measured (docs/checks.md#coord-check, widths
    # 64–512, 3 AdamW steps, lr 1e-3…3e-2, 2–12 blocks): μP's groups ≤ +0.10; SP's readout
    # reaches ≥ +0.51 and its block groups ≥ +0.86 at every t. 0.3 sits between them.
    coord_slope: float = 0.3
    # …and below −coord-shrink a group shrinks with width (its updates vanish, or the
    # narrow models are overdriven). μP at lr 1e-2: down to −0.48 (the narrowest model moves
    # its weights by half their norm per step); SP never shrinks (≥ −0.01). Against the
    # `mup` package's own μP (docs/checks.md, "μP against the reference"): at
    # lr 1e-2 it reaches −0.80, so a shrink whose narrowest width moves its matrices by a
    # median ≥ update-ratio-warn per step is info; below that drive both implementations
    # stay ≥ −0.54 (64 sweeps, none flagged). The hidden rate divided by width twice shrinks
    # the block groups only to −0.36…−0.78 there (the undivided vectors and embeddings still
    # move every block): the band flags 4 of 32 such sweeps, a known blind spot.
    coord_shrink: float = 0.7
    # A slope needs this many widths: two always fit a line exactly, three show a trend.
    coord_min_widths: float = 3

    # ---- compare: precision divergence (not a check: reported, not gated) ----------------
    # Relative RMS error ‖a−b‖/‖a‖ of a layer's output against the higher precision. One
    # bf16 rounding is ≤ 2^-8 ≈ 0.4% per element (RMS ≈ 0.2%); at init the shipped configs
    # stay ≲ 3% at every module in bf16, so 5% means amplified rounding error.
    divergence_rel_err: float = 0.05

    def with_overrides(self, overrides: Mapping[str, float | str] | None) -> Thresholds:
        if not overrides:
            return self
        known = {f.name.replace("_", "-"): f.name for f in fields(self)}
        values: dict[str, float] = {}
        for key, raw in overrides.items():
            name = known.get(str(key).replace("_", "-"))
            if name is None:
                raise UsageError(f"unknown threshold '{key}' (known: {', '.join(sorted(known))})")
            try:
                value = float(raw)
            except (TypeError, ValueError):
                raise UsageError(f"threshold '{key}' must be a number, got {raw!r}") from None
            if value != value or value < 0:
                raise UsageError(f"threshold '{key}' must be a non-negative number, got {raw!r}")
            values[name] = value
        return replace(self, **values)

    def as_dict(self) -> dict[str, float]:
        return {f.name.replace("_", "-"): getattr(self, f.name) for f in fields(self)}


DEFAULT = Thresholds()


def parse_threshold_options(items: list[str] | None) -> dict[str, str]:
    """`--threshold NAME=VALUE` (repeatable) into a dict."""
    out: dict[str, str] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--threshold expects NAME=VALUE, got '{item}'")
        out[key.strip()] = value.strip()
    return out
