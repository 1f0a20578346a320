"""Models the ZeRO and HSDP tests share (run on the engines too: the tests folder
is importable from the repository root, where the engines start)."""

import torch

FROZEN = ("blocks.0.frozen.weight", "blocks.0.frozen.bias")
FROZEN += ("blocks.1.frozen.weight", "blocks.1.frozen.bias")
"""The frozen parameters of :func:`branchy_model`."""


def branchy_model():
    """Two blocks (ZeRO units) and a head. In each block a frozen layer sits between
    two trained ones, cut by the boundary between the 2 ranks' slices (block: 195
    elements, slices of 98), and a side branch runs on even steps only: the model
    users bring (frozen parameters, a parameter a step does not touch) for
    tests/test_zero.py and tests/test_hsdp.py. Built inside a function so that the
    engines get the classes with it."""
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(6, 7)
            self.frozen = nn.Linear(7, 7).requires_grad_(False)
            self.b = nn.Linear(7, 6)
            self.side = nn.Linear(6, 6)

        def forward(self, x, even):  # (B, 6) -> (B, 6)
            h = self.b(torch.tanh(self.frozen(torch.tanh(self.a(x)))))
            return x + h + self.side(x) if even else x + h

    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Block(), Block()])
            self.head = nn.Linear(6, 3)

        def forward(self, x, step):  # (B, 6) -> (B, 3)
            for block in self.blocks:
                x = block(x, step % 2 == 0)
            return self.head(x)

    with torch.random.fork_rng():
        torch.manual_seed(0)
        return Branchy()
