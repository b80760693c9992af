"""The classifier in its own loop, protected by Stalwart: start it with a launcher."""

import argparse

import torch
import torch.nn.functional as F
from convnet import ConvNet, SyntheticImages

import stalwart


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--global-batch", type=int, default=32)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = ConvNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=20, gamma=0.5)
    data = stalwart.Data(SyntheticImages(), global_batch=args.global_batch)

    def train(ctx: stalwart.Context) -> None:
        for step in ctx.steps(args.steps):
            for images, labels in ctx.batches(data):
                loss = F.cross_entropy(model(images), labels)
                loss.backward()
                ctx.report_loss(loss)
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            if step % 10 == 0 and ctx.dp_rank == 0:
                print(f"step {step} loss {loss.item():.4f}")

    result = stalwart.run(train, model=model, optimizer=optimizer, scheduler=scheduler,
                          data=data)
    if result is not None:
        print(f"trained {result.steps} steps; param_digest {result.param_digest}")


if __name__ == "__main__":
    main()
