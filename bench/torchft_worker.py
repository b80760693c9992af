"""The peer a user would pick instead of Stalwart, run by `stalwart bench recovery`: the same
GPT trained data-parallel under TorchFT (PyPI `torchft`), one process per replica group.

    python -m stalwart.bench.torchft_worker SPEC.json GROUP   (one per replica group)

Each replica group is one process with its own TCPStore and a TorchFT Manager that joins
the quorum of a `torchft_lighthouse`; gradients are averaged with `Manager.allreduce`
and the step commits through TorchFT's `Optimizer` wrapper. This script averages the
gradients itself instead of using `torchft.ddp.DistributedDataParallel`: its stock comm
hook crashed the surviving replica on every kill here (`assert fut._fut`). A replacement
(started by the benchmark after the kill, as a scheduler would) heals from a live
replica through TorchFT's own checkpoint transport. Every process appends timestamped
events to a JSON-lines file the benchmark reads back.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from stalwart.bench.events import emitter

STARTED_UNIX = time.time()


def worker(spec_path: Path, group: int) -> int:
    spec = json.loads(spec_path.read_text())
    incarnation = int(os.environ.get("STALWART_TORCHFT_INCARNATION", "0"))
    emit = emitter(Path(spec["events_dir"]) / f"group{group}-{incarnation}.jsonl")
    emit("process_start", at=STARTED_UNIX)

    import torch
    from torch import nn
    from torch.distributed import TCPStore
    from torchft import Manager, Optimizer, ProcessGroupGloo

    from stalwart_examples.gpt import config, layers
    from stalwart_examples.gpt.data import TextWindows, load_corpus

    torch.set_num_threads(1)
    emit("imported")
    train = spec["train"]
    cfg = config(spec["model"], **spec.get("model_overrides", {}))
    spec_layers = layers(cfg)
    torch.manual_seed(train["seed"])  # every replica starts from the same weights
    model = nn.Sequential(*(factory() for _, factory in spec_layers.blocks))
    inner = torch.optim.AdamW(model.parameters(), lr=train.get("lr", 3e-4))
    windows = TextWindows(load_corpus(train.get("corpus_bytes", 4 << 20)), cfg.seq_len)
    groups = spec["groups"]
    per_group = train["global_batch"] // groups

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])
        emit("healed")

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ft = spec["torchft"]
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=ft["timeout_s"])),
        load_state_dict=load_state_dict, state_dict=state_dict, min_replica_size=1,
        timeout=timedelta(seconds=ft["timeout_s"]),
        quorum_timeout=timedelta(seconds=ft["quorum_timeout_s"]),
        rank=0, world_size=1, store_addr="127.0.0.1", store_port=store.port,
        lighthouse_addr=spec["lighthouse"], replica_id=f"group{group}",
        heartbeat_interval=timedelta(milliseconds=ft["heartbeat_ms"]))
    optimizer = Optimizer(manager, inner)
    emit("built")
    kill_step = spec["kill_step"] if group == spec["victim"] and incarnation == 0 else None
    stop = Path(spec["stop_file"])  # the benchmark's word that it has seen what it needs
    while manager.current_step() < spec["max_steps"] and not stop.exists():
        step = manager.current_step() + 1
        optimizer.zero_grad()  # starts the quorum for this step
        g = torch.Generator().manual_seed(train["seed"] * 1_000_003 + step)
        order = torch.randperm(len(windows), generator=g)
        at = (manager.participating_rank() or 0) * per_group
        x, y = zip(*(windows[int(i)] for i in order[at:at + per_group]), strict=True)
        loss = spec_layers.loss(model(torch.stack(x)), torch.stack(y))
        loss.backward()
        for p in model.parameters():
            if p.grad is not None:
                manager.allreduce(p.grad).wait()
        optimizer.step()  # commits only when every participant's step went through
        committed = manager.current_step() >= step
        emit("step", step=manager.current_step(), committed=committed, loss=float(loss),
             participants=manager.num_participants())
        if kill_step is not None and committed and manager.current_step() >= kill_step:
            emit("fault", step=manager.current_step())
            os.kill(os.getpid(), signal.SIGKILL)
    emit("done", step=manager.current_step())
    manager.shutdown(wait=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(worker(Path(sys.argv[1]), int(sys.argv[2])))
