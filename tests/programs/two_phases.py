"""A protected loop with two backward passes per step, as a GAN's: the discriminator
learns from ctx.batches, then the generator learns from a second backward on the same
samples, through the updated discriminator, and takes its own optimizer step. Every
rank that finishes writes both models' parameters as JSON."""

import json
import os
import sys

import torch
import torch.nn.functional as F

import stalwart

GLOBAL_BATCH = 8


class Real(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 400

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.randn(4, generator=torch.Generator().manual_seed(index)) * 0.5 + 1.0


def build() -> tuple[torch.nn.Module, torch.nn.Module, torch.optim.Optimizer,
                     torch.optim.Optimizer]:
    torch.manual_seed(0)
    gen = torch.nn.Sequential(torch.nn.Linear(2, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    disc = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    return (gen, disc, torch.optim.Adam(gen.parameters(), lr=0.01),
            torch.optim.Adam(disc.parameters(), lr=0.01))


def disc_loss(gen: torch.nn.Module, disc: torch.nn.Module, real: torch.Tensor) -> torch.Tensor:
    fake = gen(real[:, :2]).detach()
    ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)
    return (F.binary_cross_entropy_with_logits(disc(real), ones)
            + F.binary_cross_entropy_with_logits(disc(fake), zeros))


def gen_loss(gen: torch.nn.Module, disc: torch.nn.Module, real: torch.Tensor) -> torch.Tensor:
    # Each replica's generator gradient comes from its own samples.
    return F.binary_cross_entropy_with_logits(disc(gen(real[:, :2])), torch.ones(len(real), 1))


def main() -> None:
    steps = int(sys.argv[sys.argv.index("--steps") + 1])
    gen, disc, gen_opt, disc_opt = build()
    data = stalwart.Data(Real(), global_batch=GLOBAL_BATCH, shuffle=False)

    def train(ctx: stalwart.Context) -> None:
        for _ in ctx.steps(steps):
            for real in ctx.batches(data):
                disc_loss(gen, disc, real).backward()
            disc_opt.step()
            disc_opt.zero_grad()
            gen_loss(gen, disc, real).backward()  # the last micro-batch's samples
            gen_opt.step()
            gen_opt.zero_grad()
            disc_opt.zero_grad()

    result = stalwart.run(train, model=disc, optimizer=disc_opt, data=data,
                          state={"gen": gen, "gen_optimizer": gen_opt})
    if result is not None:
        path = os.path.join(os.environ["PARAMS_DIR"], f"{os.getpid()}.json")
        with open(path, "w") as f:
            json.dump({f"{key}.{k}": v.tolist() for key, module in (("gen", gen), ("disc", disc))
                       for k, v in module.state_dict().items()}, f)


if __name__ == "__main__":
    main()
