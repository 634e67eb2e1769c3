"""pytest example: fail the test suite when a change breaks the model's activation scale.

Run with `pytest examples/test_model_health.py`. `TinyModel` stands in for your model:
build yours the way training builds it and feed it a batch like your data loader's.
"""

import torch
from torch import nn

from actscan import scan


class Block(nn.Module):
    def __init__(self, d: int, n_blocks: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        with torch.no_grad():  # scale the residual projection by 1/sqrt(depth)
            self.mlp[-1].weight.mul_(n_blocks**-0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class TinyModel(nn.Module):
    def __init__(self, n_features: int = 16, d: int = 64, n_blocks: int = 6) -> None:
        super().__init__()
        self.embed = nn.Linear(n_features, d)
        self.blocks = nn.ModuleList(Block(d, n_blocks) for _ in range(n_blocks))
        self.head = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def test_model_keeps_a_sane_scale_at_init():
    torch.manual_seed(0)
    model = TinyModel()  # your model, built as training builds it
    batch = torch.randn(8, 32, 16)  # inputs as your data loader yields them
    report = scan(model, batch, loss_fn=lambda out: out.square().mean())
    report.assert_healthy(fail_on="warn")  # AssertionError listing the findings
