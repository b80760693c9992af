"""A protected loop that records which samples each replica read in each step (for the
no-sample-skipped-or-repeated test): every item of its dataset carries its own index.
GLOBAL_BATCH sets the global batch (default 8)."""

import json
import os
import sys

import torch
import torch.nn.functional as F

import stalwart


class Indexed(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 50

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.full((4,), float(index))
        return x, x.sum().reshape(1) * 0.01


def main() -> None:
    steps = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 12
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = stalwart.Data(Indexed(), global_batch=int(os.environ.get("GLOBAL_BATCH", "8")),
                         seed=1)
    log = open(os.path.join(os.environ["SAMPLES_DIR"], f"{os.getpid()}.jsonl"), "a")

    def train(ctx: stalwart.Context) -> None:
        for step in ctx.steps(steps):
            seen = []
            for x, y in ctx.batches(data):
                seen += [int(v) for v in x[:, 0].tolist()]
                loss = F.mse_loss(model(x * 0.01), y)
                loss.backward()
                ctx.report_loss(loss)
            optimizer.step()
            optimizer.zero_grad()
            log.write(json.dumps({"generation": ctx.generation, "step": step,
                                  "dp_rank": ctx.dp_rank, "samples": seen}) + "\n")
            log.flush()

    stalwart.run(train, model=model, optimizer=optimizer, data=data)


if __name__ == "__main__":
    main()
