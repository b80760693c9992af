"""Stalwart's 3D loop with a stage of blocks that hold no tensors at all (an activation
and a dropout): pp=3 with stage bounds that give the middle stage only those, for the
tests of a rank with nothing to optimize, capture or restore but the RNG and data."""

import sys

import torch
import torch.nn.functional as F

import stalwart


class Scaled(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x) * 1.5


class Points(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 1024

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        x = torch.randn(8, generator=torch.Generator().manual_seed(i))
        return x, int(x[0] > 0)


def main() -> None:
    steps = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 10
    layers = stalwart.Layers(blocks=[("fc", lambda: torch.nn.Linear(8, 16)), ("act", Scaled),
                                     ("drop", lambda: torch.nn.Dropout(0.2)),
                                     ("head", lambda: torch.nn.Linear(16, 2))],
                             loss=F.cross_entropy)
    result = stalwart.run_layers(layers, stalwart.Data(Points(), global_batch=12), steps=steps,
                                 pp=3, microbatches=3, stage_bounds=[(0, 0), (1, 2), (3, 3)])
    if result is not None:
        print(f"trained {result.steps} steps; param_digest {result.param_digest}")


if __name__ == "__main__":
    main()
