"""The report's `dynamics` as JSON and back (documented in docs/report-format.md, Dynamics).

Plain data, no torch: `Report.to_dict` / `Report.from_dict` call these.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from actscan.records import (
    BlockUpdates,
    ChangeRecord,
    Dynamics,
    LogitStats,
    OptimizerInfo,
    StepRecord,
    UpdateRecord,
)
from actscan.steps.derived import block_updates


def dynamics_to_dict(d: Dynamics) -> dict[str, Any]:
    opt = asdict(d.optimizer)
    opt["betas"] = list(d.optimizer.betas) if d.optimizer.betas is not None else None
    return {
        "optimizer": opt,
        "probe": d.probe,
        "steps": [
            {
                "t": s.t,
                "loss": s.loss,
                "lr": s.lr,
                "stream": [{"k": k, "rms": rms} for k, rms in s.stream],
                "change": [asdict(c) for c in s.change],
                "logits": asdict(s.logits) if s.logits is not None else None,
                "attn_max": s.attn_max,
                "gain_drift": [{"name": n, "drift": v} for n, v in s.gain_drift],
                "attn_layers": [{"name": n, "max": v} for n, v in s.attn_layers],
            }
            for s in d.steps
        ],
        "updates": [
            {**asdict(u), "ratio": list(u.ratio), "grad_rms": list(u.grad_rms)} for u in d.updates
        ],
        "blocks": [asdict(b) for b in d.blocks],
    }


def _num(x: Any) -> float | None:
    """A JSON number back to a float ("nan"/"inf" strings included); None stays None."""
    return None if x is None else float(x)


def _logit_stats(d: dict[str, Any] | None) -> LogitStats | None:
    if d is None:
        return None
    return LogitStats(
        max=_num(d.get("max")), log_z_mean=_num(d.get("log_z_mean")),
        log_z_std=_num(d.get("log_z_std")),
    )  # fmt: skip


def dynamics_from_dict(data: dict[str, Any]) -> Dynamics:
    o = data["optimizer"]
    betas = o.get("betas")
    optimizer = OptimizerInfo(
        name=o["name"], lr=float(o["lr"]), betas=tuple(betas) if betas is not None else None,
        eps=_num(o.get("eps")), weight_decay=float(o.get("weight_decay", 0.0)),
        warmup=int(o.get("warmup", 0)), parametrization=o.get("parametrization", "sp"),
    )  # fmt: skip
    steps = tuple(
        StepRecord(
            t=int(s["t"]), loss=_num(s.get("loss")), lr=float(s["lr"]),
            stream=tuple((int(p["k"]), _num(p.get("rms"))) for p in s.get("stream", ())),
            change=tuple(
                ChangeRecord(
                    name=c["name"], kind=c["kind"], k=c.get("k"), block=c.get("block"),
                    rel=_num(c.get("rel")), abs_mean=_num(c.get("abs_mean")),
                    delta_mean=_num(c.get("delta_mean")),
                )
                for c in s.get("change", ())
            ),
            logits=_logit_stats(s.get("logits")),
            attn_max=_num(s.get("attn_max")),
            gain_drift=tuple((g["name"], float(g["drift"])) for g in s.get("gain_drift", ())),
            attn_layers=tuple((a["name"], _num(a.get("max"))) for a in s.get("attn_layers", ())),
        )
        for s in data.get("steps", ())
    )  # fmt: skip
    updates = tuple(
        UpdateRecord(
            param=u["param"], block=u.get("block"), role=u.get("role", "other"),
            kind=u.get("kind", "other"), ratio=tuple(_num(x) for x in u.get("ratio", ())),
            grad_rms=tuple(_num(x) for x in u.get("grad_rms", ())), numel=int(u.get("numel", 0)),
        )
        for u in data.get("updates", ())
    )  # fmt: skip
    blocks = (
        tuple(
            BlockUpdates(
                block=b.get("block"), role=b["role"], params=int(b.get("params", 0)),
                ratio_median=_num(b.get("ratio_median")), ratio_max=_num(b.get("ratio_max")),
                grad_rms_median=_num(b.get("grad_rms_median")),
            )
            for b in data["blocks"]
        )
        if "blocks" in data
        else block_updates(updates)
    )  # fmt: skip
    return Dynamics(
        optimizer=optimizer, steps=steps, updates=updates, probe=data.get("probe"), blocks=blocks
    )
