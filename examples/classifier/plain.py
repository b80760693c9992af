"""The classifier in a plain PyTorch loop: train.py is this script protected by Stalwart."""

import argparse

import torch
import torch.nn.functional as F
from convnet import ConvNet, SyntheticImages


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--global-batch", type=int, default=32)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = ConvNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=20, gamma=0.5)
    loader = torch.utils.data.DataLoader(SyntheticImages(), batch_size=args.global_batch,
                                         shuffle=True)

    def train() -> None:
        for step, (images, labels) in zip(range(args.steps), loader, strict=False):
            loss = F.cross_entropy(model(images), labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            if step % 10 == 0:
                print(f"step {step} loss {loss.item():.4f}")

    train()

if __name__ == "__main__":
    main()
