"""`scan(steps=N)`: the step loop measures what an independent training loop gives, and
the caller's model comes back bit for bit (also when a step raises)."""

from __future__ import annotations

import contextlib
import copy
import json
import math
from typing import Any

import pytest
import torch
from torch import nn

from actscan import Report, scan
from actscan.errors import UsageError
from actscan.measure.inputs import next_token_loss, random_tokens
from actscan.measure.state import caller_state
from actscan.models.arch import ArchConfig
from actscan.models.gpt import ActscanGPT, build_model
from actscan.steps.loop import PROBE_INDEX, probe_rows, warmup_factor

VOCAB, SEQ, BATCH, SEED = 61, 12, 4, 3


def tiny(layers: int = 2, d: int = 32, **kw: object) -> ActscanGPT:
    cfg = ArchConfig(n_layers=layers, d_model=d, n_heads=2, vocab_size=VOCAB, seq_len=SEQ, **kw)
    return build_model(cfg, 0)


def ids(index: int) -> torch.Tensor:
    return random_tokens(VOCAB, BATCH, SEQ, SEED, index)


def run(model: nn.Module, **kw: Any) -> Report:
    return scan(model, batch=BATCH, seq_len=SEQ, seed=SEED, **kw)


def hand_loop(
    model: ActscanGPT,
    steps: int,
    lr: float,
    warmup: int = 0,
    weights: list[list[torch.Tensor]] | None = None,
) -> tuple[list[str], list[list[float]], list[dict[str, torch.Tensor]]]:
    """The same training by hand: AdamW on batches 0..N-1, weights before and after each
    step, and the probe's outputs at every t (`weights`, when given, gets W_0..W_N)."""
    model = copy.deepcopy(model).train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    probe = random_tokens(VOCAB, BATCH, SEQ, SEED, PROBE_INDEX)[: probe_rows(model, BATCH)]
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    outs: list[dict[str, torch.Tensor]] = []
    ratios: list[list[float]] = []

    def probe_outputs() -> dict[str, torch.Tensor]:
        got: dict[str, torch.Tensor] = {}
        hooks = [
            m.register_forward_hook(lambda _m, _a, o, n=n: got.setdefault(n, o.detach().clone()))
            for n, m in model.named_modules()
            if n in ("blocks.1", "blocks.0.mlp", "head")
        ]
        with torch.no_grad():
            model(probe)
        for h in hooks:
            h.remove()
        return got

    for t in range(steps + 1):
        outs.append(probe_outputs())
        if weights is not None:
            weights.append([p.detach().double().clone() for p in params])
        if t == steps:
            break
        x = ids(t)
        loss = next_token_loss(model(x), x)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        for g in opt.param_groups:
            g["lr"] = lr * warmup_factor(t, warmup)
        before = [p.detach().clone() for p in params]
        opt.step()
        ratios.append(
            [
                float((p.detach().double() - b.double()).norm() / b.double().norm())
                for p, b in zip(params, before, strict=True)
            ]
        )
    return names, ratios, outs


def test_steps_zero_is_todays_report() -> None:
    model = tiny()
    plain, zero = run(model), run(model, steps=0)
    assert zero.dynamics is None
    assert plain.to_json() == zero.to_json()


def steps_on(model: nn.Module, spec: Any, grads: list[Any] | None = None) -> Any:
    """`run_steps` on `model` (weights left moved) from batch 0's gradients, as a scan
    hands them over; `grads`, if given, is the list handed over (to see it emptied)."""
    from actscan.layout.detect import detect_layout
    from actscan.measure.inputs import default_loss, token_source
    from actscan.steps.loop import run_steps

    params = [p for p in model.parameters() if p.requires_grad]
    src = token_source(VOCAB, BATCH, SEQ, seed=SEED)
    loss_of = default_loss("causal-lm", VOCAB)
    b = src(0)
    loss = loss_of(model(*b.args), b)
    handed = grads if grads is not None else []
    handed[:] = torch.autograd.grad(loss, params)
    return run_steps(
        model,
        spec,
        layout=detect_layout(model),
        source=src,
        step0=(loss.detach(), handed),
        loss_of=loss_of,
        prepare=lambda x: x,
        autocast=contextlib.nullcontext,
        vocab_size=VOCAB,
    )


def test_update_ratios_and_probe_change_match_a_hand_written_adamw_loop() -> None:
    model = tiny()
    report = run(model, steps=2, lr=3e-3)
    names, ratios, outs = hand_loop(model, 2, 3e-3)
    dyn = report.dynamics
    assert dyn is not None and [u.param for u in dyn.updates] == names
    checked = 0
    for j, u in enumerate(dyn.updates):
        for t in range(2):
            want = ratios[t][j]
            if math.isfinite(want):
                assert u.ratio[t] == pytest.approx(want, rel=1e-5), (u.param, t)
                checked += 1
            else:  # a zero-initialised bias: ‖W_t‖ = 0, undefined
                assert u.ratio[t] is None
    assert checked > 20
    # the probe: ‖x_t − x_0‖/‖x_0‖, mean |x_t|, mean |x_t − x_0|
    for t in (1, 2):
        change = {c.name: c for c in dyn.steps[t].change}
        for name in ("blocks.1", "blocks.0.mlp", "head"):
            x0, xt = outs[0][name].double(), outs[t][name].double()
            c = change[name]
            assert c.rel == pytest.approx(float((xt - x0).norm() / x0.norm()), rel=1e-4)
            assert c.abs_mean == pytest.approx(float(xt.abs().mean()), rel=1e-4)
            assert c.delta_mean == pytest.approx(float((xt - x0).abs().mean()), rel=1e-4)
    assert {c.rel for c in dyn.steps[0].change} == {0.0}
    kinds = {c.kind for c in dyn.steps[1].change}
    assert kinds == {"stream", "attn", "mlp", "head"}


def test_cumulative_drift_and_step_rms_match_the_hand_written_loop() -> None:
    """drift = ‖W_t − W_0‖/‖W_0‖ (not the sum of the per-step ratios: weights that grow
    with their updates hide a large lr from those) and step_rms = ‖W_t − W_{t−1}‖/√n."""
    model = tiny()
    report = run(model, steps=3, lr=1e-2)
    ws: list[list[torch.Tensor]] = []
    hand_loop(model, 3, 1e-2, weights=ws)
    dyn = report.dynamics
    assert dyn is not None
    checked = 0
    for j, u in enumerate(dyn.updates):
        assert len(u.drift) == 3 and len(u.step_rms) == 3
        w0 = ws[0][j]
        for t in range(1, 4):
            step = float((ws[t][j] - ws[t - 1][j]).norm()) / math.sqrt(w0.numel())
            assert u.step_rms[t - 1] == pytest.approx(step, rel=1e-5), (u.param, t)
            if float(w0.norm()) > 0:
                want = float((ws[t][j] - w0).norm() / w0.norm())
                assert u.drift[t - 1] == pytest.approx(want, rel=1e-5), (u.param, t)
                checked += 1
            else:  # a zero-initialised bias: undefined
                assert u.drift[t - 1] is None
    assert checked > 20
    # after the first step the cumulative movement is the one step's ratio, and later it
    # differs from the steps' sum (the steps do not all point the same way)
    u = next(u for u in dyn.updates if u.kind == "weight")
    assert u.drift[0] == pytest.approx(u.ratio[0], rel=1e-6)
    assert u.drift[2] < sum(r for r in u.ratio if r is not None)


def test_each_step_records_loss_stream_logits_attention_and_gains() -> None:
    model = tiny()
    report = run(model, steps=2)
    dyn = report.dynamics
    assert dyn is not None and [s.t for s in dyn.steps] == [0, 1, 2]
    # t = 0 is the profile itself
    assert dyn.steps[0].stream == tuple((p.k, p.rms) for p in report.stream)
    with torch.no_grad():
        x = ids(0)
        assert dyn.steps[0].loss == pytest.approx(float(next_token_loss(model(x), x)), rel=1e-5)
        probe = random_tokens(VOCAB, BATCH, SEQ, SEED, PROBE_INDEX)[:1]
        logits = model(probe).double()
        lz = torch.logsumexp(logits, -1)
    lg = dyn.steps[0].logits
    assert lg is not None
    assert lg.max == pytest.approx(float(logits.max()), rel=1e-5)
    assert lg.log_z_mean == pytest.approx(float(lz.mean()), rel=1e-5)
    assert lg.log_z_std == pytest.approx(float(lz.std(correction=0)), rel=1e-3)
    for s in dyn.steps:
        assert s.loss is not None and s.loss > 0
        assert [k for k, _ in s.stream] == [p.k for p in report.stream]
        assert all(v is not None and v > 0 for _, v in s.stream)
        assert s.attn_max is not None and s.attn_max > 0
    assert dyn.steps[0].gain_drift and all(v == 0.0 for _, v in dyn.steps[0].gain_drift)
    assert all(v > 0 for _, v in dyn.steps[2].gain_drift)  # every gain moved
    assert dyn.optimizer.name == "adamw" and dyn.optimizer.parametrization == "sp"
    u = next(u for u in dyn.updates if u.param == "blocks.1.mlp.down.weight")
    assert (u.block, u.role, u.kind) == (1, "mlp", "weight")
    assert len(u.ratio) == 2 and len(u.grad_rms) == 2
    g = torch.func.grad(
        lambda w: next_token_loss(
            torch.func.functional_call(model, {"blocks.1.mlp.down.weight": w}, (ids(0),)), ids(0)
        )
    )(model.blocks[1].mlp.down.weight.detach())
    assert u.grad_rms[0] == pytest.approx(float(g.detach().pow(2).mean().sqrt()), rel=1e-4)


def test_warmup_is_linear_and_sgd_moves_by_lr_times_gradient() -> None:
    model = tiny()
    dyn = run(model, steps=3, warmup=2, lr=1e-2).dynamics
    assert dyn is not None
    assert [s.lr for s in dyn.steps] == pytest.approx([5e-3, 1e-2, 1e-2, 1e-2])
    assert dyn.optimizer.warmup == 2
    dyn = run(model, steps=1, optimizer="sgd", lr=0.5).dynamics
    assert dyn is not None and dyn.optimizer.betas is None and dyn.optimizer.eps is None
    u = next(u for u in dyn.updates if u.param == "blocks.0.attn.proj.weight")
    w = model.blocks[0].attn.proj.weight
    want = 0.5 * u.grad_rms[0] * math.sqrt(w.numel()) / float(w.detach().norm())  # ‖lr·g‖ / ‖W‖
    assert u.ratio[0] == pytest.approx(want, rel=1e-4)


def test_warmup_longer_than_the_steps_measures_the_first_steps_of_that_schedule() -> None:
    """`--warmup 2000 --steps 3` is the first 3 steps of a 2000-step warmup: the recorded
    lrs are lr·(t+1)/2000 and the updates applied are those of a hand loop on that schedule
    (so a user who warms up long can look at the start of their own run)."""
    model = tiny()
    lr, warmup = 3e-1, 2000
    dyn = run(model, steps=3, lr=lr, warmup=warmup).dynamics
    assert dyn is not None and dyn.optimizer.warmup == warmup
    assert [s.lr for s in dyn.steps] == pytest.approx([lr * (t + 1) / warmup for t in range(4)])
    names, ratios, _ = hand_loop(model, 3, lr, warmup=warmup)
    assert [u.param for u in dyn.updates] == names
    checked = 0
    for j, u in enumerate(dyn.updates):
        for t in range(3):
            if math.isfinite(ratios[t][j]):
                assert u.ratio[t] == pytest.approx(ratios[t][j], rel=1e-5), (u.param, t)
                checked += 1
    assert checked > 20


def _state(model: nn.Module) -> tuple[object, ...]:
    return (
        {k: v.clone() for k, v in model.state_dict().items()},
        [None if p.grad is None else (id(p.grad), p.grad.clone()) for p in model.parameters()],
        [p.requires_grad for p in model.parameters()],
        [m.training for m in model.modules()],
    )


def _same(a: tuple[object, ...], b: tuple[object, ...]) -> None:
    sd_a, grads_a, flags_a, modes_a = a
    sd_b, grads_b, flags_b, modes_b = b
    assert sd_a.keys() == sd_b.keys()  # type: ignore[attr-defined]
    for k in sd_a:  # type: ignore[attr-defined]
        assert torch.equal(sd_a[k], sd_b[k]), k  # type: ignore[index]
    for ga, gb in zip(grads_a, grads_b, strict=True):  # type: ignore[call-overload]
        assert (ga is None) == (gb is None)
        if ga is not None:
            assert ga[0] == gb[0] and torch.equal(ga[1], gb[1])
    assert flags_a == flags_b and modes_a == modes_b


def _prepared() -> ActscanGPT:
    model = tiny(norm="layernorm")
    model.eval()
    model.blocks[0].train()
    model.blocks[1].mlp.up.weight.requires_grad_(False)
    model.head.weight.grad = torch.full_like(model.head.weight, 0.25)
    return model


def test_the_callers_model_is_unchanged_after_steps() -> None:
    model = _prepared()
    before = _state(model)
    dyn = run(model, steps=2, lr=1e-2).dynamics
    assert dyn is not None and "blocks.1.mlp.up.weight" not in {u.param for u in dyn.updates}
    _same(before, _state(model))


def test_the_callers_model_is_unchanged_when_a_step_raises() -> None:
    model = _prepared()
    before = _state(model)
    calls = [0]

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("boom in step 2")
        return out.float().square().mean()

    with pytest.raises(RuntimeError, match="boom"):
        run(model, steps=4, loss_fn=loss_fn)
    assert calls[0] == 3
    _same(before, _state(model))


def test_the_kept_copy_stands_for_w0_only_while_the_weights_are_untouched() -> None:
    model = tiny()
    params = list(model.parameters())
    with caller_state(model) as kept:
        w0 = kept.of(params)
        assert w0 is not None
        assert all(v is not p and torch.equal(v, p) for v, p in zip(w0, params, strict=True))
        with torch.no_grad():
            params[0].mul_(1.0)  # written in place: same values, but no longer trusted
        assert kept.of(params) is None and kept.of(params[1:]) is not None
        params[1].data = params[1].data.double()  # the run's cast replaces the storage
        assert kept.of(params[1:]) is None
    assert kept.of([nn.Parameter(torch.zeros(2))]) is None


def test_a_cast_run_takes_its_own_copy_and_measures_the_same_ratios() -> None:
    model = tiny()
    before = _state(model)
    f32 = run(model, steps=2, lr=3e-3).dynamics  # W_0: the caller's kept copy
    f64 = run(model, steps=2, lr=3e-3, dtype=torch.float64).dynamics  # W_0: its own
    assert f32 is not None and f64 is not None
    _same(before, _state(model))
    for a, b in zip(f32.updates, f64.updates, strict=True):
        for ra, rb in zip(a.ratio, b.ratio, strict=True):
            assert (ra is None) == (rb is None)
            if ra is not None:
                assert ra == pytest.approx(rb, rel=1e-3), a.param


def test_param_groups_hook_sets_per_group_learning_rates() -> None:
    class Grouped(ActscanGPT):
        def actscan_param_groups(self, lr: float) -> list[dict]:
            emb = [self.tok_emb.weight]  # tied with the head
            rest = [p for p in self.parameters() if p is not self.tok_emb.weight]
            return [{"params": rest}, {"params": emb, "lr": lr / 10}]

    cfg = ArchConfig(n_layers=2, d_model=32, n_heads=2, vocab_size=VOCAB, seq_len=SEQ)
    torch.manual_seed(0)
    plain = ActscanGPT(cfg)
    grouped = Grouped(cfg)
    grouped.load_state_dict(plain.state_dict())
    ra = {u.param: u for u in run(plain, steps=1, optimizer="adam").dynamics.updates}  # type: ignore[union-attr]
    rb = {u.param: u for u in run(grouped, steps=1, optimizer="adam").dynamics.updates}  # type: ignore[union-attr]
    # Adam's first step moves every element by ~lr: a tenth of the lr, a tenth the update
    emb = "tok_emb.weight"
    assert rb[emb].ratio[0] == pytest.approx(ra[emb].ratio[0] / 10, rel=1e-3)
    assert rb["blocks.0.mlp.up.weight"].ratio[0] == pytest.approx(
        ra["blocks.0.mlp.up.weight"].ratio[0], rel=1e-6
    )


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"steps": -1}, "--steps"),
        ({"steps": 1, "lr": 0.0}, "--lr"),
        ({"steps": 1, "lr": float("nan")}, "--lr"),
        ({"steps": 1, "optimizer": "lion"}, "--optimizer"),
        ({"steps": 1, "backward": False}, "--no-backward"),
        ({"steps": 1, "warmup": -1}, "--warmup"),
        ({"steps": 1, "eps": -1.0}, "--eps"),
    ],
)
def test_bad_step_settings_are_usage_errors(kw: dict, needle: str) -> None:
    with pytest.raises(UsageError, match=needle):
        run(tiny(), **kw)


def test_a_model_with_nothing_to_train_is_a_usage_error() -> None:
    model = tiny()
    model.requires_grad_(False)
    with pytest.raises(UsageError, match="nothing to train"):
        run(model, steps=1)


def test_dynamics_json_round_trips_and_validates() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    from actscan.report.schema import validate_report

    report = run(tiny(), steps=2, warmup=1)
    data = json.loads(report.to_json())
    validate_report(data)
    dyn = data["dynamics"]
    assert dyn["optimizer"] == {
        "name": "adamw",
        "lr": 1e-3,
        "betas": [0.9, 0.95],
        "eps": 1e-8,
        "weight_decay": 0.0,
        "warmup": 1,
        "parametrization": "sp",
    }
    assert [s["t"] for s in dyn["steps"]] == [0, 1, 2]
    assert dyn["steps"][1]["stream"][0].keys() == {"k", "rms"}
    assert {"ratio", "grad_rms", "param", "block", "role", "kind"} <= dyn["updates"][0].keys()
    back = Report.from_dict(data)
    assert back.dynamics == report.dynamics
    assert back.to_json() == report.to_json()
    bad = json.loads(report.to_json())
    bad["dynamics"]["steps"][0]["lr"] = "fast"
    with pytest.raises(jsonschema.ValidationError):
        validate_report(bad)
    assert "dynamics" not in json.loads(run(tiny()).to_json())


# -- the command line ------------------------------------------------------------------
TINY = [
    "gpt-12-preln",
    "--set",
    "n_layers=2",
    "--set",
    "d_model=32",
    "--set",
    "n_heads=2",
    "--set",
    "vocab_size=64",
    "--batch",
    "2",
    "--seq-len",
    "8",
]


def cli(*args: str) -> Any:
    from typer.testing import CliRunner

    from actscan.cli import app

    return CliRunner().invoke(app, list(args), env={"NO_COLOR": "1", "COLUMNS": "150"})


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--steps", "-1"], "--steps"),
        (["--steps", "2", "--lr", "0"], "--lr"),
        (["--steps", "2", "--lr", "nan"], "--lr"),
        (["--steps", "2", "--optimizer", "lion"], "--optimizer"),
        (["--steps", "2", "--no-backward"], "--no-backward"),
        (["--steps", "2", "--warmup", "-1"], "--warmup"),
    ],
)
def test_cli_bad_step_options_are_one_line_exit_2(args: list[str], needle: str) -> None:
    from helpers import one_line_error

    one_line_error(cli("profile", *TINY, *args), needle)


def test_cli_warmup_2000_steps_3_records_the_first_lrs_of_that_schedule(tmp_path: Any) -> None:
    out = tmp_path / "r.json"
    args = ["--steps", "3", "--warmup", "2000", "--lr", "0.01", "--json", str(out), "-q"]
    result = cli("profile", *TINY, *args)
    assert result.exit_code == 0, result.output
    dyn = json.loads(out.read_text())["dynamics"]
    assert dyn["optimizer"]["warmup"] == 2000
    assert [s["lr"] for s in dyn["steps"]] == pytest.approx(
        [0.01 * (t + 1) / 2000 for t in range(4)]
    )


def test_cli_profile_steps_renders_the_tables_and_writes_json(tmp_path: Any) -> None:
    out = tmp_path / "r.json"
    result = cli("profile", *TINY, "--steps", "2", "--lr", "0.01", "--json", str(out))
    assert result.exit_code in (0, 1), result.output
    text = result.stdout
    for needle in (
        "2 optimizer steps: adamw lr 0.01",
        "Residual stream over the steps",
        "t=2",
        "Updates per block",
        "loss ",
        "attn max",
        "log Z",
    ):
        assert needle in text, needle
    data = json.loads(out.read_text())
    assert data["dynamics"]["optimizer"]["lr"] == 0.01 and len(data["dynamics"]["steps"]) == 3
    md = cli("profile", *TINY, "--steps", "1", "--format", "markdown", "-q")
    assert "#### Optimizer steps (1)" in md.stdout and "median ‖ΔW‖/‖W‖" in md.stdout


@pytest.mark.slow
def test_cli_compare_with_steps_puts_the_sides_side_by_side() -> None:
    result = cli("compare", *TINY, "--vs-set", "placement=post", "--steps", "2", "--json", "-")
    assert result.exit_code in (0, 1), result.output
    data = json.loads(result.stdout)
    steps = data["steps"]
    assert steps["a"]["steps"] == 2 and steps["b"]["ratio_spread"] is not None
    assert [k for k, _, _ in steps["amplification"]] == [0, 2, 4]
    assert data["a"]["dynamics"] and data["b"]["dynamics"]
    table = cli("compare", *TINY, "--vs-set", "placement=post", "--steps", "2")
    assert "Steps verdict:" in table.stdout and "Amplification" in table.stdout


def test_steps_verdict_names_the_side_with_even_updates_and_small_change() -> None:
    from dataclasses import replace

    from actscan.compare.steps import compare_steps
    from actscan.records import BlockUpdates, ChangeRecord, StepRecord

    base = run(tiny(), steps=1).dynamics
    assert base is not None

    def side(spread: float, amp: float) -> Any:
        blocks = (
            BlockUpdates(0, "mlp", 1, 0.01, 0.01, 1e-3),
            BlockUpdates(1, "mlp", 1, 0.01 * spread, 0.01, 1e-3),
        )
        last = StepRecord(
            t=1, loss=1.0, lr=1e-3, change=(ChangeRecord("blocks.1", "stream", 4, 1, amp),)
        )
        return replace(base, blocks=blocks, steps=(base.steps[0], last))

    assert compare_steps(side(1.2, 0.5), side(8.0, 2.0)).saner == "a"
    assert compare_steps(side(8.0, 2.0), side(1.2, 0.5)).saner == "b"
    mixed = compare_steps(side(1.2, 2.0), side(8.0, 0.5))
    assert mixed.saner is None and mixed.verdict.startswith("mixed")
    assert compare_steps(side(1.2, 0.5), side(1.25, 0.52)).saner is None


def test_cli_sweep_passes_steps_to_every_row() -> None:
    args = [
        "sweep",
        "gpt-12-preln",
        "--depth",
        "1,2",
        "--set",
        "d_model=32",
        "--set",
        "n_heads=2",
        "--set",
        "vocab_size=64",
        "--batch",
        "2",
        "--seq-len",
        "8",
    ]
    result = cli(*args, "--steps", "1", "--lr", "0.01", "--json", "-", "-q")
    assert result.exit_code in (0, 1), result.output
    rows = json.loads(result.stdout)["rows"]
    assert len(rows) == 2
    for row in rows:
        dyn = row["report"]["dynamics"]
        assert dyn["optimizer"]["lr"] == 0.01 and len(dyn["steps"]) == 2


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.ReLU(), nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class _Net(nn.Module):
    def __init__(self, d: int = 16, n: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.blocks = nn.ModuleList(_Block(d) for _ in range(n))
        self.out = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


def test_a_custom_model_cycles_the_users_batches_without_logits_or_attention() -> None:
    torch.manual_seed(0)
    net = _Net()
    batches = [torch.randn(4, 8, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    seen: list[float] = []

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        loss = out.square().mean()
        seen.append(float(loss.detach()))
        return loss

    dyn = scan(net, inputs=batches, loss_fn=loss_fn, steps=3, lr=1e-2).dynamics
    assert dyn is not None
    assert all(s.logits is None and s.attn_max is None for s in dyn.steps)
    # the step's batch t is the user's batch t mod 2; the loss each step reports is its own
    assert [s.loss for s in dyn.steps] == pytest.approx(seen, rel=1e-6)
    with torch.no_grad():
        assert seen[0] == pytest.approx(float(net(batches[0]).square().mean()), rel=1e-6)
    kinds = {c.kind for c in dyn.steps[1].change}
    assert "stream" in kinds and "mlp" in kinds
    assert dyn.steps[3].change[-1].rel > 0
    assert {u.param for u in dyn.updates} == {n for n, _ in net.named_parameters()}


def test_a_bucketed_step_is_the_whole_optimizer_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The optimizer steps bucket by bucket (each bucket's W_t copied just before): the
    same figures, bit for bit, as one step of every parameter at once, or one per
    parameter; and the gradients handed to the first update are freed as it reads them."""
    import actscan.steps.loop as loop

    model = tiny()
    got = {"default": run(model, steps=2, lr=1e-2, weight_decay=0.1).to_json()}
    n = len(list(model.parameters()))
    assert loop._buckets(list(model.parameters())) == [list(range(n))]  # small: one bucket
    sizes = [10, 3 << 20, 5, 5, (1 << 20) - 10, 1]  # a large one alone; runs up to 1M values
    meta = [torch.empty(k, device="meta") for k in sizes] + [torch.empty(3, dtype=torch.half)]
    assert loop._buckets(meta) == [[0], [1], [2, 3, 4], [5], [6]]
    variants = {
        "each": lambda ps: [[k] for k in range(len(ps))],
        "pairs": lambda ps: [list(range(k, min(k + 2, len(ps)))) for k in range(0, len(ps), 2)],
    }
    monkeypatch.setattr(loop, "_units", lambda *_: None)  # the bucketed path (a GPU's)
    for name, buckets in variants.items():
        monkeypatch.setattr(loop, "_buckets", buckets)
        got[name] = run(model, steps=2, lr=1e-2, weight_decay=0.1).to_json()
    assert got["each"] == got["pairs"]
    got["bucketed"] = run(model, steps=2, lr=1e-2, weight_decay=0.1).to_json()
    assert got["bucketed"] == got["each"]
    monkeypatch.undo()
    # run_steps empties a list of step-0 gradients (each freed once its bucket stepped)
    from actscan.steps.loop import StepSpec

    grads: list[torch.Tensor | None] = []
    steps_on(copy.deepcopy(model).train(), StepSpec(1), grads)
    assert grads == []


@pytest.mark.parametrize("case", ["finite", "nan", "inf", "first step"])
def test_compiled_update_figures_match_an_fp64_sum_and_the_torch_passes(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step's ‖W_t‖², ‖ΔW‖², ‖W_{t+1} − W_0‖² and non-finite flag from the compiled read
    (actscan/steps/fused_moved.py) against the same fp32 differences summed in fp64 (to
    1e-12), and against `_moved`'s torch passes (their fp32 norms, to 1e-4): over several
    chunks and groups, an inf or a NaN in the update, and the first step (no W_0: the
    drift is the update)."""
    from actscan.steps import fused_moved
    from actscan.steps.loop import _moved

    g = torch.Generator().manual_seed(3)
    n = 3 * (1 << 20) + 17
    old = torch.randn(n, generator=g)
    now = old + 1e-3 * torch.randn(n, generator=g)
    w0 = old + 1e-2 * torch.randn(n, generator=g)
    if case == "nan":
        now[5] = math.nan
    if case == "inf":
        now[n - 3] = math.inf
    first = w0 if case != "first step" else None
    pytest.importorskip("llvmlite", reason="llvmlite (the `fast` extra) is not installed")
    assert fused_moved.supports(old, now)  # installed, so the loop must build
    got = _moved(old.clone(), now, first)
    d = (old - now).double()
    want = [old.double().square().sum(), d.square().sum()]
    want.append((now - w0).double().square().sum() if first is not None else want[1])
    bad = float(case in ("nan", "inf"))
    assert float(got[3]) == bad
    for a, b in zip(got[:3], want, strict=True):
        assert torch.allclose(a, b, rtol=1e-12, equal_nan=True), (a, b)
    with monkeypatch.context() as m:
        m.setattr(fused_moved, "_kernels", lambda: None)
        torch_passes = _moved(old.clone(), now, first)
    assert float(torch_passes[3]) == bad
    for a, b in zip(got[:3], torch_passes[:3], strict=True):  # torch's fp32 norms: 2e-5
        assert torch.allclose(a, b, rtol=1e-4, equal_nan=True), (a, b)


def test_compiled_sum_loops_at_every_length_around_their_vector_width() -> None:
    """`jit.sum_kernel`'s loops (parameter moments, update figures, change sums) at every
    length from 0 to two vector steps and one over: the vector part, the tail, and where
    one meets the other, against the same fp32 values summed in fp64; a non-finite
    difference counted wherever it falls."""
    pytest.importorskip("llvmlite", reason="llvmlite (the `fast` extra) is not installed")
    from actscan.measure import jit, reduce_kernels
    from actscan.steps import moved_kernel

    g = torch.Generator().manual_seed(7)
    for n in range(2 * jit.LANES * jit.UNROLL + 2):
        x, y, z = (torch.randn(n, generator=g) for _ in range(3))
        xd, d, r = x.double(), (x - y).double(), (y - z).double()
        got = torch.zeros(2, dtype=torch.float64)
        reduce_kernels.sums(x, got)
        assert torch.allclose(got, torch.stack([xd.sum(), xd.square().sum()]), rtol=1e-12)
        got = torch.zeros(4, dtype=torch.float64)
        moved_kernel.moved(x, y, z, got)
        want = [xd.square().sum(), d.square().sum(), r.square().sum(), torch.tensor(0.0)]
        assert torch.allclose(got, torch.stack(want).double(), rtol=1e-12), n
        got = torch.zeros(4, dtype=torch.float64)
        moved_kernel.change(x, y, got)
        want = [d.square().sum(), xd.square().sum(), xd.abs().sum(), d.abs().sum()]
        assert torch.allclose(got, torch.stack(want), rtol=1e-12), n
        if n:
            x[n - 1], x[n // 2] = math.inf, math.nan
            got = torch.zeros(4, dtype=torch.float64)
            moved_kernel.moved(x, y, z, got)
            assert got[3] == len({n - 1, n // 2}), n


def test_compiled_change_sums_match_an_fp64_sum() -> None:
    """A probe point's Σ(x − x0)², Σx², Σ|x|, Σ|x − x0| (`fused_moved.change`) against the
    same fp32 values summed in fp64 (to 1e-12), over a size no lane width divides."""
    pytest.importorskip("llvmlite", reason="llvmlite (the `fast` extra) is not installed")
    from actscan.steps import fused_moved

    g = torch.Generator().manual_seed(5)
    n = (1 << 20) + 13
    x, x0 = torch.randn(n, generator=g), torch.randn(n, generator=g)
    assert fused_moved.fits(x, x0)
    sums = torch.zeros(4, dtype=torch.float64)
    fused_moved.change(x, x0, sums)
    d, xd = (x - x0).double(), x.double()
    want = torch.stack([d.square().sum(), xd.square().sum(), xd.abs().sum(), d.abs().sum()])
    assert torch.allclose(sums, want, rtol=1e-12), (sums, want)
    assert not fused_moved.fits(x[::2], x0[::2])  # strided: torch's passes take it


def test_the_steps_figures_are_the_same_without_the_compiled_loops(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the compiled loops (the update figures, the probe's change sums) and with
    torch's passes alone, one run's gradient RMS, update ratios, probe change and
    non-finite records agree; the run that diverges (an inf update, then NaN gradients)
    flags the same stages and names either way."""
    pytest.importorskip("llvmlite", reason="llvmlite (the `fast` extra) is not installed")
    from test_divergence import _planted

    from actscan.steps import fused_moved

    def both(make: Any, **kw: Any) -> tuple[Any, Any]:
        fast = run(make(), **kw).dynamics
        with monkeypatch.context() as m:
            m.setattr(fused_moved, "_kernels", lambda: None)
            slow = run(make(), **kw).dynamics
        assert fast is not None and slow is not None
        return fast, slow

    fast, slow = both(tiny, steps=2, lr=3e-3)
    checked = 0
    for a, b in zip(fast.updates, slow.updates, strict=True):
        for x, y in [
            *zip(a.grad_rms, b.grad_rms, strict=True),
            *zip(a.ratio, b.ratio, strict=True),
        ]:
            assert (x is None) == (y is None)
            if x is not None and y is not None:
                assert x == pytest.approx(y, rel=1e-5, abs=1e-12), a.param
                checked += 1
    assert checked > 40
    for s, r in zip(fast.steps, slow.steps, strict=True):
        for c, e in zip(s.change, r.change, strict=True):
            for x, y in ((c.rel, e.rel), (c.abs_mean, e.abs_mean), (c.delta_mean, e.delta_mean)):
                assert x == pytest.approx(y, rel=1e-5, abs=1e-12), (s.t, c.name)
    fast, slow = both(_planted, steps=3, optimizer="sgd", lr=1e-3)
    assert [s.nonfinite for s in fast.steps] == [s.nonfinite for s in slow.steps]
    assert any(stage == "gradient" for s in fast.steps for stage, _ in s.nonfinite)


class _Grouped(ActscanGPT):
    """The built-in model with two param groups, the MLPs at a tenth of the lr, and its
    last parameter in neither (so never stepped)."""

    def actscan_param_groups(self, lr: float) -> list[dict[str, Any]]:
        named = list(self.named_parameters())[:-1]
        return [
            {"params": [p for n, p in named if ".mlp." not in n]},
            {"params": [p for n, p in named if ".mlp." in n], "lr": lr / 10},
        ]


@pytest.mark.parametrize("optimizer", ["adamw", "adam", "sgd"])
def test_the_piecewise_cpu_step_writes_the_whole_optimizers_weights_bit_for_bit(
    optimizer: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a CPU the steps run each optimizer on pieces of the parameters (`_units`: here
    of 300 values, so pieces cut parameters and units span several): after three steps
    with warmup, weight decay, two param groups and a parameter whose memory is not
    contiguous (stepped whole), every weight equals the one torch's
    optimizer over the whole parameters writes (the bucketed path), bit for bit, and the
    update figures agree to rounding (their sums are taken piece by piece)."""
    import actscan.steps.loop as loop

    base = tiny()
    base.__class__ = _Grouped
    up = base.blocks[0].mlp.up
    up.weight = nn.Parameter(up.weight.detach().t().contiguous().t())
    assert not up.weight.is_contiguous()
    monkeypatch.setattr(loop, "_CHUNK", 300)
    sizes = [p.numel() for p in base.parameters()]
    assert max(sizes) > 300 and min(sizes) < 300  # cut, and grouped with neighbours
    spec = loop.StepSpec(3, optimizer=optimizer, lr=3e-3, weight_decay=0.1, warmup=2)
    pieces, whole = copy.deepcopy(base).train(), copy.deepcopy(base).train()
    built: list[Any] = []
    units = loop._units
    monkeypatch.setattr(loop, "_units", lambda *a: built.append(units(*a)) or built[-1])
    got = steps_on(pieces, spec)
    assert built and len(built[0]) > 2 and {u.group for u in built[0]} == {0, 1, -1}
    monkeypatch.setattr(loop, "_units", lambda *_: None)
    want = steps_on(whole, spec)
    for (name, a), b in zip(pieces.named_parameters(), whole.parameters(), strict=True):
        assert torch.equal(a, b), name
    assert not torch.equal(next(pieces.parameters()), next(base.parameters()))  # it moved
    assert torch.equal(list(pieces.parameters())[-1], list(base.parameters())[-1])  # no group
    assert got.losses == want.losses
    pairs = [(got.ratio, want.ratio, 1e-12), (got.drift, want.drift, 1e-12)]
    pairs.append((got.grad_rms, want.grad_rms, 1e-6))  # fp32 norms, piece by piece
    for rows_a, rows_b, rel in pairs:
        for ra, rb in zip(rows_a, rows_b, strict=True):
            assert [x is None for x in ra] == [x is None for x in rb]
            assert [x for x in ra if x is not None] == pytest.approx(
                [x for x in rb if x is not None], rel=rel
            )
