"""A small convolutional image classifier and a synthetic image set it can learn.

Each image is a class-specific pattern plus noise, drawn from (seed, index) on demand,
so the data set needs no download and no storage.
"""

from __future__ import annotations

import torch
from torch import nn

CLASSES = 10


class SyntheticImages(torch.utils.data.Dataset):
    """`size` RGB images of 16x16 pixels in CLASSES classes."""

    def __init__(self, size: int = 4096, seed: int = 0) -> None:
        self.size, self.seed = size, seed
        gen = torch.Generator().manual_seed(seed)
        self.patterns = torch.randn(CLASSES, 3, 16, 16, generator=gen)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        label = int(torch.randint(CLASSES, (), generator=gen))
        noise = torch.randn(3, 16, 16, generator=gen)
        return self.patterns[label] + 1.5 * noise, label


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(),
                                  nn.Linear(64, CLASSES))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images))
