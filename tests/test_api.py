"""The Python API as the README states it: `from actscan import scan` on a user's own
nn.Module with the user's inputs and loss, a Report with the JSON's field names, and a
model left exactly as it was (weights bit for bit, modes, hooks, requires_grad, .grad,
dtype, device), also when the forward raises."""

from __future__ import annotations

import copy
import inspect
import json
import sys
from dataclasses import fields, replace
from typing import Any

import pytest
import torch
from helpers import planted_checks
from torch import nn

from actscan import Finding, LayerRecord, Report, Severity, scan
from actscan.render.formats import to_markdown
from actscan.report.schema import validate_report


# -- a user-style model (nothing actscan-specific about it) ----------------------------
class MLP(nn.Module):
    def __init__(self, d: int, n_blocks: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, 4 * d)
        self.act = nn.GELU()
        self.down = nn.Linear(4 * d, d)
        with torch.no_grad():  # GPT-2 style 1/sqrt(2L) on the residual projection
            self.down.weight.mul_((2 * n_blocks) ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))


class Mixer(nn.Module):
    """Token mixing by a causal running mean, then a projection (an attention stand-in)."""

    def __init__(self, d: int, n_blocks: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d)
        with torch.no_grad():
            self.proj.weight.mul_((2 * n_blocks) ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        steps = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype)
        return self.proj(x.cumsum(1) / steps[None, :, None])


class Block(nn.Module):
    def __init__(self, d: int, n_blocks: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d)
        self.attn = Mixer(d, n_blocks)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = MLP(d, n_blocks)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.norm1(x)))
        return x + self.drop(self.mlp(self.norm2(x)))


class ResidualNet(nn.Module):
    """Features (B, T, F) → a pre-norm residual stack → one regression output per token."""

    def __init__(self, n_features: int = 8, d: int = 32, n_blocks: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(n_features, d)
        self.bn = nn.BatchNorm1d(d)  # running statistics: a forward in train mode moves them
        self.blocks = nn.ModuleList(Block(d, n_blocks) for _ in range(n_blocks))
        self.norm = nn.LayerNorm(d)
        self.out = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        h = self.bn(self.inp(x).transpose(1, 2)).transpose(1, 2)
        for block in self.blocks:
            h = block(h)
        return self.out(self.norm(h)) * scale


def make_net(seed: int = 0) -> ResidualNet:
    torch.manual_seed(seed)
    return ResidualNet()


def features(seed: int = 1) -> torch.Tensor:
    return torch.randn(4, 16, 8, generator=torch.Generator().manual_seed(seed))


def mse(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def kill_branch(net: ResidualNet, block: int = 2) -> str:
    """Plant a dead MLP branch: its output layer zeroed (a classic init/loading bug)."""
    with torch.no_grad():
        net.blocks[block].mlp.down.weight.zero_()
        net.blocks[block].mlp.down.bias.zero_()
    return f"blocks.{block}.mlp"


# -- the contract -------------------------------------------------------------------------
def test_from_actscan_import_scan_is_the_function() -> None:
    import actscan
    import actscan.run  # the implementation module lives under another name …

    # … so importing it never shadows the API's `scan`
    assert inspect.isfunction(scan) and actscan.scan is scan is actscan.run.scan
    params = inspect.signature(scan).parameters
    assert list(params)[:3] == ["model", "inputs", "loss_fn"]
    assert all(params[n].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for n in list(params)[:3])
    assert params["inputs"].default is None and params["loss_fn"].default is None
    contract = {"dtype": None, "batches": 1, "backward": True, "modules": None, "thresholds": None}
    for name, default in contract.items():
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY
        assert params[name].default == default


def test_report_uses_the_json_field_names() -> None:
    report = scan(make_net(), features(), mse)
    assert isinstance(report, Report)
    data = json.loads(report.to_json())
    validate_report(data)
    assert {f.name for f in fields(LayerRecord)} >= set(data["layers"][0])
    assert [x.name for x in report.layers] == [x["name"] for x in data["layers"]]
    assert [p.k for p in report.stream] == [p["k"] for p in data["stream"]]
    assert [p.rms for p in report.stream] == [p["rms"] for p in data["stream"]]
    assert report.summary == data["summary"]
    assert {"growth_exponent", "gain_per_block"} <= set(report.summary)
    assert len(report.findings) == len(data["findings"])
    # The stream: the first block's input, then one point per block (k counts branches).
    assert [p.name for p in report.stream] == ["blocks.0:input"] + [f"blocks.{i}" for i in range(4)]
    assert [p.k for p in report.stream] == [0, 2, 4, 6, 8]
    md = to_markdown(report)
    assert md.startswith("### actscan:") and "| 8 | 3 | `blocks.3` |" in md


def test_statistics_match_an_independent_computation() -> None:
    """The run is as training runs it (BatchNorm on batch statistics), dropout off."""
    net, x = make_net(), features()
    seen: dict[str, torch.Tensor] = {}
    handle = net.blocks[1].mlp.register_forward_hook(lambda m, a, out: seen.update(out=out))
    reference = copy.deepcopy(net).train()
    for m in reference.modules():
        if isinstance(m, nn.Dropout):
            m.eval()
    handle.remove()
    reference.blocks[1].mlp.register_forward_hook(lambda m, a, out: seen.update(out=out))
    with torch.no_grad():
        reference(x)
    ref = seen["out"].double()
    rec = scan(net, x, mse).layer("blocks.1.mlp")
    assert rec.type == "MLP" and rec.role == "mlp" and rec.block == 1 and rec.calls == 1
    assert rec.rms == pytest.approx(ref.square().mean().sqrt().item(), rel=1e-5)
    assert rec.max_abs == pytest.approx(ref.abs().max().item(), rel=1e-6)
    assert rec.grad_rms is not None and rec.grad_rms > 0


def test_user_inputs_as_tuple_and_dict_reach_the_model_and_loss() -> None:
    net = make_net()
    got: list[torch.Tensor] = []

    def loss(out: torch.Tensor) -> torch.Tensor:
        got.append(out.detach())
        return out.mean()

    x = features()
    scan(net, (x, 3.0), loss)
    scan(net, {"x": x, "scale": 3.0}, loss)
    net.train()  # as scan() runs it: batch statistics, dropout off
    for m in net.modules():
        if isinstance(m, nn.Dropout):
            m.eval()
    with torch.no_grad():
        want = net(x, 3.0)
    assert len(got) == 2 and all(torch.allclose(g, want) for g in got)


def test_default_loss_mean_square_and_options() -> None:
    net, x = make_net(), features()
    report = scan(net, x, batches=2, modules=r"^blocks\.\d+\.mlp$")
    assert [x.name for x in report.layers] == [f"blocks.{i}.mlp" for i in range(4)]
    assert all(x.calls == 1 and x.grad_rms and x.grad_rms > 0 for x in report.layers)
    assert report.run.batches == 2 and report.run.backward is True
    fwd = scan(net, x, backward=False)
    assert fwd.run.backward is False and all(x.grad_rms is None for x in fwd.layers)
    bf16 = scan(net, x, mse, dtype="bf16")
    assert bf16.run.dtype == "bf16"
    assert bf16.layer("blocks.0.mlp").rms == pytest.approx(
        report.layer("blocks.0.mlp").rms, rel=0.05
    )


def test_thresholds_reach_the_checks() -> None:
    """scan(thresholds=...) as the spine scan() calls receives it (its check runner planted)."""
    from actscan.run import scan_model, scan_settings

    seen: dict[str, Any] = {}

    def run_checks(ctx: Any) -> tuple[Finding, ...]:
        seen["th"] = ctx.thresholds
        return ()

    settings = scan_settings(thresholds={"outlier-ratio": 3.5, "outlier_abs": 2})
    scan_model(
        make_net(), settings, inputs=features(), loss_fn=mse, checks=planted_checks(run_checks)
    )
    assert (seen["th"].outlier_ratio, seen["th"].outlier_abs) == (3.5, 2.0)
    from actscan.errors import UsageError

    with pytest.raises(UsageError, match="no-such"):
        scan(make_net(), features(), mse, thresholds={"no-such": 1.0})


# -- assert_healthy --------------------------------------------------------------------------
def test_healthy_user_model_passes() -> None:
    scan(make_net(), features(), mse).assert_healthy()


def test_planted_dead_branch_is_caught_by_assert_healthy() -> None:
    net = make_net()
    dead = kill_branch(net)
    report = scan(net, features(), mse)
    found = [f for f in report.findings if f.check == "dead-branch"]
    assert found, f"no dead-branch finding; findings: {report.findings}"
    assert any(dead in f.layers for f in found)
    assert not any(f"blocks.{i}.mlp" in f.layers for f in found for i in (0, 1, 3)), (
        "only the planted branch is dead"
    )
    with pytest.raises(AssertionError) as err:
        report.assert_healthy()
    text = str(err.value)
    assert "dead-branch" in text and dead in text


def test_ignore_takes_a_finding_out_of_assert_healthy() -> None:
    """scan(ignore=...) gates as `[tool.actscan] ignore` does on the command line."""
    net = make_net()
    dead = kill_branch(net)
    rule = {"check": "dead-branch", "layers": r"blocks\.2\.", "reason": "zeroed on purpose"}
    report = scan(net, features(), mse, ignore=[rule])
    assert not [f for f in report.findings if f.check == "dead-branch"]
    report.assert_healthy()  # the only finding is ignored
    # A rule for another layer leaves the planted branch in the gate.
    other = scan(net, features(), mse, ignore=[{**rule, "layers": r"blocks\.0\."}])
    with pytest.raises(AssertionError, match=r"dead-branch[^\n]*blocks\.2\.mlp"):
        other.assert_healthy()
    # The project's own rules (Ignore objects) are accepted as they are.
    from actscan import Ignore

    ignored = scan(net, features(), mse, ignore=(Ignore("dead-branch", "zeroed", dead),))
    assert ignored.findings == report.findings


@pytest.mark.parametrize(
    ("ignore", "fragment"),
    [
        ([{"check": "dead-branch"}], "ignore[0] needs reason"),
        ([{"check": "no-such", "reason": "r"}], "'no-such' is not a check id"),
        ([{"check": "collapse", "reason": "r", "layers": "("}], "ignore[0] layers"),
        ([{"check": "collapse", "reason": "r", "why": 1}], "unknown key 'why'"),
        ({"check": "collapse", "reason": "r"}, "must be a list"),
    ],
)
def test_bad_ignore_rules_are_refused_before_running(ignore: Any, fragment: str) -> None:
    from actscan.errors import UsageError

    class Boom(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise AssertionError("the model must not run")

    with pytest.raises(UsageError) as err:
        scan(Boom(), features(), mse, ignore=ignore)
    assert str(err.value).startswith("scan(): ") and fragment in str(err.value)


def test_scan_target_is_the_cli_path_from_python() -> None:
    """The library entry point the CLI calls: target + Settings → report, ignores applied."""
    from actscan import Ignore, Settings, TargetSpec, scan_target

    planted = tuple(
        Finding(check, Severity.WARN, (layer,), 0.0, 1e-3, f"planted {check}")
        for check, layer in (("dead-branch", "blocks.1.mlp"), ("collapse", "blocks.0.mlp"))
    )
    checks = planted_checks(lambda ctx: planted)
    spec = TargetSpec("gpt-12-preln", overrides=("n_layers=2", "d_model=32", "n_heads=2"))
    plain = scan_target(spec, Settings(batch=2, seq_len=8), checks=checks)
    assert (plain.report.run.batch, plain.report.run.seq_len) == (2, 8)
    assert plain.report.findings == planted and plain.ignored == ()
    rule = Ignore("dead-branch", "LayerScale at 0", layers=r"\.1\.")
    kept = scan_target(spec, Settings(batch=2, seq_len=8, ignores=(rule,)), checks=checks)
    assert kept.report.findings == planted[1:]
    assert kept.ignored == ((planted[0], "LayerScale at 0"),)
    with pytest.raises(AssertionError, match="collapse"):
        kept.report.assert_healthy()


def _with(report: Report, *severities: str) -> Report:
    return replace(
        report,
        findings=tuple(
            Finding(
                check=f"check-{i}",
                severity=Severity(s),
                layers=(f"blocks.{i}.mlp",),
                value=1.0,
                threshold=0.5,
                message=f"message {i}",
            )
            for i, s in enumerate(severities)
        ),
    )


@pytest.mark.parametrize(
    ("severities", "fail_on", "listed"),
    [
        (("info", "warn", "error"), "warn", ["check-1", "check-2"]),
        (("info", "warn", "error"), "info", ["check-0", "check-1", "check-2"]),
        (("info", "warn"), "error", []),
        (("info", "warn", "error"), "never", []),
        (("info",), "warn", []),
        ((), "info", []),
    ],
)
def test_assert_healthy_gate(severities: tuple[str, ...], fail_on: str, listed: list[str]) -> None:
    base = scan(make_net(), features(), mse, modules=r"^blocks\.0$")
    report = _with(base, *severities)
    if not listed:
        report.assert_healthy(fail_on=fail_on)
        return
    with pytest.raises(AssertionError) as err:
        report.assert_healthy(fail_on=fail_on)
    text = str(err.value)
    assert f"{len(listed)} finding(s)" in text
    for i, sev in enumerate(severities):
        assert (f"check-{i}: message {i}" in text) == (f"check-{i}" in listed)
        if f"check-{i}" in listed:
            assert f"[{sev}]" in text and f"blocks.{i}.mlp" in text


def test_assert_healthy_default_gate_is_warn() -> None:
    base = scan(make_net(), features(), mse, modules=r"^blocks\.0$")
    _with(base, "info").assert_healthy()
    with pytest.raises(AssertionError):
        _with(base, "warn").assert_healthy()


# -- the model is left exactly as it was -----------------------------------------------------
def _hook_dicts(model: nn.Module) -> dict[str, list[tuple[str, list[Any]]]]:
    names = (
        "_forward_hooks",
        "_forward_pre_hooks",
        "_backward_hooks",
        "_backward_pre_hooks",
        "_forward_hooks_with_kwargs",
        "_forward_pre_hooks_with_kwargs",
        "_forward_hooks_always_called",
        "_state_dict_hooks",
        "_load_state_dict_pre_hooks",
    )
    return {
        mname: [(n, list(getattr(m, n).items())) for n in names if hasattr(m, n)]
        for mname, m in model.named_modules()
    }


def _global_hooks() -> list[list[Any]]:
    from torch.nn.modules import module as M

    names = [n for n in dir(M) if n.startswith("_global_") and n.endswith("hooks")]
    return [list(getattr(M, n).items()) for n in sorted(names)]


def _snapshot(model: nn.Module) -> dict[str, Any]:
    return {
        "state": {k: (v.dtype, v.device, v.clone()) for k, v in model.state_dict().items()},
        "tensors": {k: id(v) for k, v in model.named_parameters()},
        "buffers": {k: id(v) for k, v in model.named_buffers()},
        "modes": {n: m.training for n, m in model.named_modules()},
        "hooks": _hook_dicts(model),
        "global_hooks": _global_hooks(),
        "requires_grad": {k: p.requires_grad for k, p in model.named_parameters()},
        "grads": {
            k: None if p.grad is None else (id(p.grad), p.grad.clone())
            for k, p in model.named_parameters()
        },
    }


def _assert_same(before: dict[str, Any], model: nn.Module) -> None:
    after = _snapshot(model)
    assert after["state"].keys() == before["state"].keys()
    for k, (dtype, device, value) in before["state"].items():
        a_dtype, a_device, a_value = after["state"][k]
        assert (a_dtype, a_device) == (dtype, device), k
        # bit for bit: compare the raw bytes, not values (−0.0 == 0.0, NaN != NaN)
        raw = value.reshape(-1).view(torch.uint8)
        assert torch.equal(a_value.reshape(-1).view(torch.uint8), raw), k
    for key in ("tensors", "buffers", "modes", "hooks", "global_hooks", "requires_grad"):
        assert after[key] == before[key], key
    for k, g in before["grads"].items():
        a = after["grads"][k]
        if g is None:
            assert a is None, f"{k}.grad appeared"
        else:
            assert a is not None and a[0] == g[0] and torch.equal(a[1], g[1]), k


def _dressed_model() -> ResidualNet:
    """A model in a state a user's test might hand over: mixed modes, user hooks, a frozen
    layer, some accumulated .grad, others None."""
    net = make_net()
    net.train()
    net.blocks[1].eval()  # mixed modes
    net.blocks[3].drop.eval()
    calls: list[str] = []
    net.blocks[0].register_forward_hook(lambda m, a, o: calls.append("fwd"))
    net.blocks[0].mlp.register_forward_pre_hook(lambda m, a: None)
    net.out.register_full_backward_hook(lambda m, gi, go: None)
    net.norm.register_forward_hook(lambda m, a, kw, o: None, with_kwargs=True)
    for p in net.inp.parameters():
        p.requires_grad_(False)
    mse(net(features(5))).backward()  # .grad on every trainable parameter
    net.blocks[2].mlp.down.weight.grad = None  # …but not this one
    net.bn.running_mean.add_(0.5)
    return net


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"dtype": "bf16"},
        {"dtype": torch.float16, "batches": 2},
        {"backward": False},
        {"modules": r"blocks\.1"},
    ],
    ids=["default", "bf16", "fp16-2-batches", "no-backward", "modules"],
)
def test_model_left_exactly_as_it_was(kwargs: dict[str, Any]) -> None:
    net = _dressed_model()
    before = _snapshot(net)
    report = scan(net, features(), mse, **kwargs)
    assert report.layers
    _assert_same(before, net)
    # …and it still trains as before: same outputs in train mode after the scan.
    untouched = _dressed_model()
    torch.manual_seed(3)
    out = net(features())
    torch.manual_seed(3)
    assert torch.equal(out, untouched(features()))


@pytest.mark.parametrize("dtype", [None, "bf16"])
def test_model_left_as_it_was_when_the_forward_raises(dtype: str | None) -> None:
    net = _dressed_model()
    before = _snapshot(net)
    with pytest.raises(RuntimeError):
        scan(net, torch.randn(4, 16, 5), mse, dtype=dtype)  # 5 features, the model wants 8
    _assert_same(before, net)


def test_model_left_as_it_was_when_the_loss_raises() -> None:
    net = _dressed_model()
    before = _snapshot(net)

    def broken(out: torch.Tensor) -> torch.Tensor:
        raise ValueError("user loss failed")

    with pytest.raises(ValueError, match="user loss failed"):
        scan(net, features(), broken, dtype="bf16")
    _assert_same(before, net)


def test_the_cli_calls_the_same_scan(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """scan() and the CLI run the one spine (actscan.run.scan_model)."""
    from typer.testing import CliRunner

    from actscan.cli import app

    module = sys.modules["actscan.run"]
    real = module.scan_model
    calls: list[str] = []

    def spy(model: nn.Module, *args: Any, **kwargs: Any) -> Report:
        calls.append(type(model).__name__)
        return real(model, *args, **kwargs)

    monkeypatch.setattr(module, "scan_model", spy)
    scan(make_net(), features(), mse)
    assert calls == ["ResidualNet"]
    calls.clear()
    monkeypatch.chdir(tmp_path)
    tiny = ["--set", "n_layers=2", "--set", "d_model=32", "--set", "n_heads=2", "--seq-len", "8"]
    result = CliRunner().invoke(app, ["profile", "gpt-12-preln", *tiny, "-q"])
    assert result.exit_code == 0, result.output
    assert calls == ["ActscanGPT"]
