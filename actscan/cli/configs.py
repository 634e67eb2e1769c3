"""`actscan configs`: the shipped configs and init schemes."""

from __future__ import annotations

from actscan.cli.app import app
from actscan.cli.options import handle_errors, make_console


@app.command("configs")
@handle_errors
def configs_cmd() -> None:
    """List shipped configs (usable by name as TARGET) and the init schemes."""
    from rich.table import Table

    from actscan.models.arch import INITS, build_config, read_config_file
    from actscan.targets.classify import shipped_configs

    console = make_console()
    table = Table(title="Shipped configs (actscan profile NAME)", title_justify="left")
    for col in (
        "name",
        "layers",
        "d_model",
        "norm",
        "placement",
        "activation",
        "branch scale",
        "init",
        "file",
    ):
        table.add_column(col)
    for name, path in shipped_configs().items():
        data = read_config_file(path)
        if data.get("family", "actscan-gpt") != "actscan-gpt" or "model_type" in data:
            table.add_row(name, "", "", "", "", "", "", "", str(path.name))
            continue
        c = build_config(data, str(path))
        table.add_row(
            name,
            str(c.n_layers),
            str(c.d_model),
            c.norm,
            c.placement,
            c.activation,
            c.branch_scale,
            c.init,
            path.name,
        )
    console.print(table)
    console.print("Init schemes (--init): " + ", ".join(INITS))
