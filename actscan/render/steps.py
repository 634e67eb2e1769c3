"""The table view of the first optimizer steps (`--steps N`): the stream over the steps,
the updates per block, and one sparkline per curve. Reads the records only: every number
was measured (actscan.steps.loop) or derived (actscan.steps.derived)."""

from __future__ import annotations

from rich import box
from rich.table import Table
from rich.text import Text

from actscan.compare.steps import StepsComparison
from actscan.numfmt import NONE, num
from actscan.records import BlockUpdates, Dynamics
from actscan.render.formats import shown_steps
from actscan.render.sparks import spark


def optimizer_line(dyn: Dynamics) -> Text:
    o = dyn.optimizer
    parts = [f"{o.name} lr {num(o.lr)}"]
    if o.betas is not None:
        parts.append(f"betas ({num(o.betas[0])}, {num(o.betas[1])})")
    if o.eps is not None:
        parts.append(f"eps {num(o.eps)}")
    if o.weight_decay:
        parts.append(f"weight decay {num(o.weight_decay)}")
    if o.warmup:
        parts.append(f"warmup {o.warmup}")
    if o.parametrization != "sp":
        parts.append(o.parametrization)
    steps = len(dyn.steps) - 1
    text = Text(f"{steps} optimizer step{'s' if steps != 1 else ''}: ", style="bold")
    text.append(" · ".join(parts))
    if dyn.probe:
        text.append(f" · probe {dyn.probe}", style="dim")
    return text


def stream_steps_table(dyn: Dynamics) -> Table | None:
    """k × t: the stream RMS on each step's batch, and the probe's relative change
    ‖x_t − x_0‖/‖x_0‖ at each k after the last step."""
    steps = shown_steps(dyn.steps)
    if not steps or not steps[0].stream:
        return None
    t = Table(
        title="Residual stream over the steps (RMS)",
        box=box.SIMPLE_HEAD,
        title_justify="left",
        pad_edge=False,
        min_width=40,
    )
    t.add_column("k", justify="right")
    for s in steps:
        t.add_column(f"t={s.t}", justify="right")
    last = dyn.steps[-1]
    t.add_column(f"Δ probe t={last.t}", justify="right")
    rel = {c.k: c.rel for c in last.change if c.kind == "stream"}
    rows = [dict(s.stream) for s in steps]
    for k, _ in steps[0].stream:
        t.add_row(str(k), *(num(r.get(k)) for r in rows), num(rel.get(k)))
    return t


def updates_table(dyn: Dynamics) -> Table | None:
    """One row per block: each role's median [max] update ratio ‖ΔW‖/‖W‖ over the steps
    and its median gradient RMS; embeddings first and the head last, in the first role's
    columns."""
    if not dyn.blocks:
        return None
    roles = list(dict.fromkeys(b.role for b in dyn.blocks if b.block is not None)) or [""]
    t = Table(
        title="Updates per block (‖ΔW‖/‖W‖ of the matrices, median \\[max] over steps)",
        box=box.SIMPLE_HEAD,
        title_justify="left",
        pad_edge=False,
        min_width=72,
    )
    t.add_column("block", justify="right")
    for role in roles:
        t.add_column(f"{role} Δ/W".strip(), justify="right")
    for role in roles:
        t.add_column(f"{role} grad RMS".strip(), justify="right")

    def ratio(b: BlockUpdates) -> Text:  # Text: "[…]" is not rich markup
        return Text(f"{num(b.ratio_median)} [{num(b.ratio_max)}]")

    def outside(b: BlockUpdates) -> None:
        blank = [""] * (len(roles) - 1)
        t.add_row(b.role, ratio(b), *blank, num(b.grad_rms_median), *blank)

    for b in dyn.blocks:
        if b.block is None and b.role == "embed":
            outside(b)
    cells: dict[int, dict[str, BlockUpdates]] = {}
    for b in dyn.blocks:
        if b.block is not None:
            cells.setdefault(b.block, {})[b.role] = b
    for block, by_role in cells.items():
        got = [by_role.get(r) for r in roles]
        t.add_row(
            str(block),
            *(NONE if b is None else ratio(b) for b in got),
            *(NONE if b is None else num(b.grad_rms_median) for b in got),
        )
    for b in dyn.blocks:
        if b.block is None and b.role != "embed":
            outside(b)
    return t


def curve_lines(dyn: Dynamics) -> list[Text]:
    """loss, largest attention score and log Z over t = 0..N: first value, sparkline, last."""
    curves: list[tuple[str, list[float | None]]] = [
        ("loss", [s.loss for s in dyn.steps]),
        ("attn max", [s.attn_max for s in dyn.steps]),
        ("log Z", [s.logits.log_z_mean if s.logits else None for s in dyn.steps]),
        ("logit max", [s.logits.max if s.logits else None for s in dyn.steps]),
    ]
    out = []
    for label, values in curves:
        if all(v is None for v in values):
            continue
        line = Text(f"{label:<10}", style="bold")
        line.append(f"{num(values[0]):>9} ")
        line.append(spark(values), style="cyan")
        line.append(f" {num(values[-1])}")
        out.append(line)
    return out


def render_dynamics(dyn: Dynamics) -> list[Table | Text]:
    """What `profile --steps N` prints after the step-0 tables, in order."""
    out: list[Table | Text] = [optimizer_line(dyn)]
    out += [tb for tb in (stream_steps_table(dyn), updates_table(dyn)) if tb is not None]
    out += curve_lines(dyn)
    return out


def render_steps_comparison(sc: StepsComparison) -> list[Table | Text]:
    """compare --steps: the sides' figures, update ratios per block and amplification
    per k, side by side (B ÷ A in the last column)."""
    fig = Table(
        title=f"After {sc.a.steps} optimizer steps",
        box=box.SIMPLE_HEAD,
        title_justify="left",
        pad_edge=False,
    )
    for col in ("", "A", "B"):
        fig.add_column(col, justify="left" if not col else "right")
    for label, x, y in (
        ("optimizer", sc.a.optimizer, sc.b.optimizer),
        (
            "loss t=0 → N",
            f"{num(sc.a.loss_first)} → {num(sc.a.loss_last)}",
            f"{num(sc.b.loss_first)} → {num(sc.b.loss_last)}",
        ),
        ("update-ratio spread (max/min block)", num(sc.a.ratio_spread), num(sc.b.ratio_spread)),
        (
            "final amplification ‖Δx‖/‖x‖",
            num(sc.a.final_amplification),
            num(sc.b.final_amplification),
        ),
        (
            "attn max t=0 → N",
            f"{num(sc.a.attn_first)} → {num(sc.a.attn_last)}",
            f"{num(sc.b.attn_first)} → {num(sc.b.attn_last)}",
        ),
        ("attn max growth ×", num(sc.a.attn_growth), num(sc.b.attn_growth)),
    ):
        fig.add_row(label, x, y)
    out: list[Table | Text] = [fig]
    if sc.updates:
        up = Table(
            title="Update ratio per block (median ‖ΔW‖/‖W‖ over steps)",
            box=box.SIMPLE_HEAD,
            title_justify="left",
            pad_edge=False,
            min_width=56,
        )
        for col in ("block", "role", "A", "B", "B ÷ A"):
            up.add_column(col, justify="left" if col == "role" else "right")
        for p in sc.updates:
            up.add_row(
                NONE if p.block is None else str(p.block),
                p.role,
                num(p.a),
                num(p.b),
                num(p.ratio),
            )
        out.append(up)
    if sc.amplification:
        amp = Table(
            title="Amplification: probe ‖x_N − x_0‖/‖x_0‖ per k",
            box=box.SIMPLE_HEAD,
            title_justify="left",
            pad_edge=False,
            min_width=48,
        )
        for col in ("k", "A", "B"):
            amp.add_column(col, justify="right")
        for k, rel_a, rel_b in sc.amplification:
            amp.add_row(str(k), num(rel_a), num(rel_b))
        out.append(amp)
    return out
