"""A protected loop over a sparse embedding (nn.Embedding(sparse=True), SparseAdam) and a
dense head (Adam, registered through state=): each replica's backward touches only its
own samples' rows. Every rank that finishes writes its parameters as JSON."""

import json
import os
import sys

import torch
import torch.nn.functional as F

import stalwart

GLOBAL_BATCH = 8


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 400

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, 50, (4,), generator=torch.Generator().manual_seed(index))
        return tokens, (tokens.sum() % 2).reshape(1).float()


def build() -> tuple[torch.nn.ModuleDict, torch.optim.Optimizer, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"emb": torch.nn.Embedding(50, 8, sparse=True),
                                 "head": torch.nn.Linear(8, 1)})
    return (model, torch.optim.SparseAdam(list(model["emb"].parameters()), lr=0.01),
            torch.optim.Adam(model["head"].parameters(), lr=0.01))


def loss_of(model: torch.nn.ModuleDict, tokens: torch.Tensor,
            targets: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(model["head"](model["emb"](tokens).mean(1)),
                                              targets)


def main() -> None:
    steps = int(sys.argv[sys.argv.index("--steps") + 1])
    model, sparse, dense = build()
    data = stalwart.Data(Tokens(), global_batch=GLOBAL_BATCH, shuffle=False)

    def train(ctx: stalwart.Context) -> None:
        for _ in ctx.steps(steps):
            for tokens, targets in ctx.batches(data):
                loss_of(model, tokens, targets).backward()
            sparse.step()
            dense.step()
            sparse.zero_grad()
            dense.zero_grad()

    result = stalwart.run(train, model=model, optimizer=sparse, data=data,
                          state={"head_optimizer": dense})
    if result is not None:
        path = os.path.join(os.environ["PARAMS_DIR"], f"{os.getpid()}.json")
        with open(path, "w") as f:
            json.dump({k: v.tolist() for k, v in model.state_dict().items()}, f)


if __name__ == "__main__":
    main()
