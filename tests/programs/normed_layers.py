"""Stalwart's 3D loop over blocks with BatchNorm (persistent buffers that every training
forward updates) and, with --dropout P, dropout (which draws from torch's RNG): pp=2 over
two ranks, for the buffer and RNG tests of the 3D loop."""

import sys

import torch
import torch.nn.functional as F

import stalwart


class Normed(torch.nn.Module):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc, self.norm = torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16)
        self.drop = torch.nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(torch.relu(self.norm(self.fc(x))))


class Points(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 2048

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        x = torch.randn(16, generator=torch.Generator().manual_seed(i))
        return x, int(x.sum() > 0)


def main() -> None:
    steps = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 12
    p = float(sys.argv[sys.argv.index("--dropout") + 1]) if "--dropout" in sys.argv else 0.0
    layers = stalwart.Layers(blocks=[*((name, lambda: Normed(p)) for name in "abc"),
                                     ("head", lambda: torch.nn.Linear(16, 2))],
                             loss=F.cross_entropy)
    result = stalwart.run_layers(layers, stalwart.Data(Points(), global_batch=16), steps=steps,
                                 pp=2, microbatches=2)
    if result is not None:
        print(f"trained {result.steps} steps; param_digest {result.param_digest}")


if __name__ == "__main__":
    main()
