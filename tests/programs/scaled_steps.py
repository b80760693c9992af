"""A protected loop that does what mixed-precision loops do between backward and the
optimizer step: GradScaler's unscale, clipping by the global gradient norm, and
GradScaler's step, which skips `optimizer.step()` when the gradients are not finite;
one layer gets no gradient at all.
Two samples hold an infinite feature (one step each); with data parallelism only one
replica reads each. Every rank that finishes writes its parameters as JSON."""

import json
import math
import os
import sys

import torch
import torch.nn.functional as F

import stalwart

GLOBAL_BATCH = 8
BAD_SAMPLES = (4 * GLOBAL_BATCH + 3, 9 * GLOBAL_BATCH + 6)  # steps 4 and 9 (no shuffle)
MAX_NORM = 0.05


class Samples(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 400

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(6, generator=torch.Generator().manual_seed(index))
        y = x[:3].sum().reshape(1)
        if index in BAD_SAMPLES:
            x[0] = math.inf
        return x, y


class Net(torch.nn.Module):
    """An MLP with a layer its forward never uses (as an unrouted expert would be)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(),
                                        torch.nn.Linear(16, 1))
        self.unused = torch.nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.amp.GradScaler]:
    torch.manual_seed(0)
    model = Net()
    # Weight decay would move the unused layer if it were given a (zero) gradient.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=3)
    return model, optimizer, scaler


def update(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
           scaler: torch.amp.GradScaler) -> None:
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()


def main() -> None:
    steps = int(sys.argv[sys.argv.index("--steps") + 1])
    model, optimizer, scaler = build()
    data = stalwart.Data(Samples(), global_batch=GLOBAL_BATCH, shuffle=False)

    def train(ctx: stalwart.Context) -> None:
        for _ in ctx.steps(steps):
            for x, y in ctx.batches(data):
                loss = F.mse_loss(model(x), y)
                scaler.scale(loss).backward()
                ctx.report_loss(loss)
            update(model, optimizer, scaler)

    result = stalwart.run(train, model=model, optimizer=optimizer, data=data,
                          state={"scaler": scaler})
    if result is not None:
        out = {"scale": scaler.get_scale(),
               "params": {k: v.tolist() for k, v in model.state_dict().items()}}
        path = os.path.join(os.environ["PARAMS_DIR"], f"{os.getpid()}.json")
        with open(path, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()
