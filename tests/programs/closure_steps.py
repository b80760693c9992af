"""A protected loop whose optimizer evaluates the loss itself: LBFGS with a strong-Wolfe
line search calls the step's closure several times per step and decides by the loss it
returns when to stop. The closure reads the step's micro-batches from ctx.batches each
time. Every rank that finishes writes its parameters as JSON."""

import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import stalwart

GLOBAL_BATCH = 8


class Samples(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 400

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(5, generator=torch.Generator().manual_seed(index))
        return x, (x[:2].prod() + x[3]).reshape(1)


def build() -> tuple[torch.nn.Module, torch.optim.LBFGS]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 12), torch.nn.Tanh(), torch.nn.Linear(12, 1))
    # A history longer than the run: the optimizer's state grows at every step.
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4, history_size=100,
                                  line_search_fn="strong_wolfe")
    return model, optimizer


def main() -> None:
    steps = int(sys.argv[sys.argv.index("--steps") + 1])
    model, optimizer = build()
    data = stalwart.Data(Samples(), global_batch=GLOBAL_BATCH, shuffle=False)

    def train(ctx: stalwart.Context) -> None:
        for _ in ctx.steps(steps):
            def closure() -> torch.Tensor:
                optimizer.zero_grad()
                total = torch.zeros(())
                for x, y in ctx.batches(data):
                    loss = F.mse_loss(model(x), y)
                    loss.backward()
                    total += loss.detach()
                return total

            ctx.report_loss(optimizer.step(closure))

    result = stalwart.run(train, model=model, optimizer=optimizer, data=data)
    if result is not None:
        out = Path(os.environ["PARAMS_DIR"]) / f"{os.getpid()}.json"
        out.write_text(json.dumps({k: v.tolist() for k, v in model.state_dict().items()}))


if __name__ == "__main__":
    main()
