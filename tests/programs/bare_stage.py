"""Stalwart's 3D loop with a first stage whose block is frozen (a pretrained embedding:
nothing before it trains, so it has no backward) and a stage of blocks that hold no
tensors at all (an activation and a dropout): pp=4, for the tests of ranks with nothing
to optimize."""

import sys

import torch
import torch.nn.functional as F

import stalwart


class Scaled(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x) * 1.5


def frozen() -> torch.nn.Module:
    block = torch.nn.Linear(8, 8)
    block.requires_grad_(False)
    return block


class Points(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 1024

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        x = torch.randn(8, generator=torch.Generator().manual_seed(i))
        return x, int(x[0] > 0)


def main() -> None:
    steps = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 10
    layers = stalwart.Layers(blocks=[("frozen", frozen), ("fc", lambda: torch.nn.Linear(8, 16)),
                                     ("act", Scaled),
                                     ("drop", lambda: torch.nn.Dropout(0.2)),
                                     ("head", lambda: torch.nn.Linear(16, 2))],
                             loss=F.cross_entropy)
    result = stalwart.run_layers(layers, stalwart.Data(Points(), global_batch=12), steps=steps,
                                 pp=4, microbatches=4,
                                 stage_bounds=[(0, 0), (1, 1), (2, 3), (4, 4)])
    if result is not None:
        print(f"trained {result.steps} steps; param_digest {result.param_digest}")


if __name__ == "__main__":
    main()
