"""The usual practice the recovery benchmark compares against: torchrun restarts every rank
when one dies, and the fresh ranks load the last torch.distributed.checkpoint (DCP) save.

    python -m stalwart.bench.recovery_baseline SPEC.json   (run by torchrun, one per rank)

`run_baseline` launches real torchrun (`torch.distributed.run --max-restarts`) over this
module; each rank builds the same ParallelDims + Trainer as Stalwart's ranks, saves DCP every
`ckpt_every` steps and SIGKILLs itself at the step the spec names for its restart round.
Every rank appends timestamped events to a JSON-lines file that the benchmark reads back.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from stalwart.bench.events import emitter, read_events

STARTED_UNIX = time.time()  # before torch is imported: process start as the launcher sees it


def _dcp_state(trainer: Any) -> dict[str, Any]:
    """Everything a restarted rank needs, as tensors only (DCP stores no pickled objects
    then). The dict's tensors are the live ones (saving reads them, loading fills them)."""
    import torch

    optim = {}
    for name, p in trainer.stage.named_parameters():
        state = trainer.optimizer.state.get(p) or {
            "step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
            "exp_avg_sq": torch.zeros_like(p)}
        trainer.optimizer.state[p] = state
        optim[name] = state
    # The data position is the step: stalwart.Data reads step s's samples from s alone.
    return {"model": trainer.stage.state_dict(), "optim": optim,
            "meta": {"step": torch.tensor(trainer.step_count, dtype=torch.int64)}}


def _latest_checkpoint(root: Path) -> tuple[int, Path] | None:
    """Newest complete save: DCP writes `.metadata` only after every rank's data."""
    done = [(int(p.name.split("-")[1]), p) for p in root.glob("step-*")
            if (p / ".metadata").exists()]
    return max(done) if done else None


def worker(spec_path: Path) -> int:
    """One rank under torchrun: build, load the last checkpoint, train, save, maybe die."""
    spec = json.loads(spec_path.read_text())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    emit = emitter(Path(spec["events_dir"]) / f"rank{rank}-round{restart}.jsonl")
    emit("process_start", at=STARTED_UNIX)

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from stalwart.client.parallel_dims import ParallelDims
    from stalwart.client.trainer import TrainConfig, Trainer
    from stalwart.core.layout import Layout
    from stalwart_examples.gpt import job

    torch.set_num_threads(1)
    emit("imported")
    dist.init_process_group("gloo", rank=rank, world_size=world)  # env:// as torchrun sets
    store = dist.distributed_c10d._get_default_store()
    lay = spec["layout"]
    dims = ParallelDims(Layout(dp=lay["dp"], pp=lay["pp"], tp=lay["tp"])).build(
        store, rank, generation=restart + 1, timeout_s=60.0)
    train = spec["train"]
    layers, data = job(spec["model"], global_batch=train["global_batch"], seed=train["seed"],
                       **spec.get("model_overrides", {}))
    trainer = Trainer(dims, layers, data, TrainConfig(seed=train["seed"]),
                      schedule=lay["schedule"], microbatches=lay["microbatches"])
    emit("built")
    root = Path(spec["ckpt_dir"])
    latest = _latest_checkpoint(root)
    if latest is not None:
        state = _dcp_state(trainer)
        dcp.load(state, checkpoint_id=str(latest[1]))
        trainer.stage.load_state_dict(state["model"])
        meta = state["meta"]
        trainer.step_count = int(meta["step"])
    emit("restored", step=trainer.step_count)
    kill = next((k for k in spec["kills"] if k["round"] == restart and k["rank"] == rank), None)
    while trainer.step_count < spec["steps"]:
        loss = trainer.step()
        step = trainer.step_count
        emit("step", step=step, loss=loss)
        if step % spec["ckpt_every"] == 0:
            t0 = time.perf_counter()
            dcp.save(_dcp_state(trainer), checkpoint_id=str(root / f"step-{step}"))
            emit("saved", step=step, save_s=time.perf_counter() - t0)
        if kill is not None and step == kill["step"]:
            emit("fault", step=step)
            os.kill(os.getpid(), signal.SIGKILL)
    dims.destroy()
    dist.destroy_process_group()
    emit("done", step=trainer.step_count)
    return 0


def run_baseline(spec: dict[str, Any], workdir: Path, timeout_s: float) -> list[dict[str, Any]]:
    """Run the job under torchrun with one restart per kill; return every rank's events.

    Raises RuntimeError (with the launcher's log tail) when torchrun fails or runs out of time.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    spec = {**spec, "events_dir": str(workdir / "events"), "ckpt_dir": str(workdir / "ckpt")}
    Path(spec["events_dir"]).mkdir(exist_ok=True)
    Path(spec["ckpt_dir"]).mkdir(exist_ok=True)
    spec_path = workdir / "baseline-spec.json"
    spec_path.write_text(json.dumps(spec))
    world = spec["layout"]["dp"] * spec["layout"]["pp"] * spec["layout"]["tp"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={world}", f"--max-restarts={len(spec['kills'])}",
           "--monitor-interval=0.1", "-m", "stalwart.bench.recovery_baseline", str(spec_path)]
    # A fresh store per restart round: torchrun's shared rendezvous store keeps the dead
    # worker's address and fails most restarts (see FIELD-NOTES).
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1", "LOGLEVEL": "WARNING"}
    log_path = workdir / "torchrun.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
            code = None
    if code != 0:
        tail = log_path.read_text(errors="replace")[-3000:]
        what = "timed out" if code is None else f"exited with {code}"
        raise RuntimeError(f"baseline torchrun job {what}; log {log_path}:\n{tail}")
    events = []
    for path in sorted(Path(spec["events_dir"]).glob("*.jsonl")):
        rank, rnd = path.stem.removeprefix("rank").split("-round")
        events += [{**e, "rank": int(rank), "round": int(rnd)} for e in read_events(path)]
    return events


if __name__ == "__main__":
    raise SystemExit(worker(Path(sys.argv[1])))
