"""A protected loop whose data set augments each sample with draws from Python's and
numpy's global generators (a random flip, a jitter), as augmentation pipelines do.
Every rank that finishes writes its parameter digest as JSON. With FAIL_FIRST_STEP set,
replica 1 raises after its first optimizer step, before that step can commit. With
SEED_BY_RANK set, each process seeds its generators with its launch rank (a spare's is
-1), as DDP scripts do to vary their augmentation, so each builds other weights. With
RUN_TWICE set, a rank that finished calls run() again and records what it raised. With
WIDTH_BY_RANK set, each rank builds a model of another width (a script's bug)."""

import json
import os
import random
import sys

import numpy as np
import torch
import torch.nn.functional as F

import stalwart


class Jittered(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 300

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(6, generator=torch.Generator().manual_seed(index))
        if random.random() < 0.5:
            x = x.flip(0)
        x = x + float(np.random.normal(0.0, 0.1)) + 0.05 * random.gauss(0.0, 1.0)
        return x, x[:2].sum().reshape(1)


def main() -> None:
    steps = int(sys.argv[sys.argv.index("--steps") + 1])
    seed = 1000 + int(os.environ["RANK"]) if os.environ.get("SEED_BY_RANK") else 0
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    width = 16 + (max(0, int(os.environ["RANK"])) if os.environ.get("WIDTH_BY_RANK") else 0)
    model = torch.nn.Sequential(torch.nn.Linear(6, width), torch.nn.Tanh(),
                                torch.nn.Linear(width, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = stalwart.Data(Jittered(), global_batch=8)

    def train(ctx: stalwart.Context) -> None:
        for _ in ctx.steps(steps):
            for x, y in ctx.batches(data):
                loss = F.mse_loss(model(x), y)
                loss.backward()
                ctx.report_loss(loss)
            optimizer.step()
            optimizer.zero_grad()
            if os.environ.get("FAIL_FIRST_STEP") and ctx.generation == 1 and ctx.dp_rank == 1:
                raise RuntimeError("replica 1 fails after its first update")

    result = stalwart.run(train, model=model, optimizer=optimizer, data=data)
    if result is not None:
        out = {"param_digest": result.param_digest}
        if os.environ.get("RUN_TWICE"):  # a second phase, as a DDP script might run it
            try:
                stalwart.run(train, model=model, optimizer=optimizer, data=data)
            except RuntimeError as exc:
                out["again"] = str(exc)
        with open(os.path.join(os.environ["PARAMS_DIR"], f"{os.getpid()}.json"), "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()
