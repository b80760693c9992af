"""The public API as a specification: what a user may import and call, what it
guarantees about registered state, and the errors bad input gets. (What `run` does
across real failures is in test_example_classifier.py and test_api_samples.py.)"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from typing import Any

import pytest
import torch
from torch import nn

import stalwart
from stalwart.client.user_state import StateRegistry

API = {"run", "Context", "Result", "Data", "Layers", "run_layers", "param_digest",
       "StateError", "JobStopped"}


def test_the_public_names_are_the_documented_ones_and_importing_them_is_cheap():
    assert set(stalwart.__all__) == API | {"__version__"}
    code = ("import sys, stalwart; assert 'torch' not in sys.modules; "
            "stalwart.Data; assert 'torch' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
    with pytest.raises(AttributeError, match="no attribute 'Trainer'"):
        stalwart.Trainer  # noqa: B018 - internals are not part of the API


def test_run_without_a_launcher_says_what_is_missing(monkeypatch):
    monkeypatch.delenv("STALWART_UNIX_SOCKET", raising=False)
    model = nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match="needs a Stalwart launcher"):
        stalwart.run(lambda ctx: None, model=model,
                     optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.parametrize("entry", ["run", "run_layers"])
def test_a_script_that_initialized_torch_distributed_itself_is_told_to_remove_it(
        monkeypatch, tmp_path, entry):
    import torch.distributed as dist

    monkeypatch.setenv("STALWART_UNIX_SOCKET", str(tmp_path / "no-daemon.sock"))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = nn.Linear(2, 2)
        with pytest.raises(RuntimeError, match=r"remove init_process_group\(\)"):
            if entry == "run":
                stalwart.run(lambda ctx: None, model=model,
                             optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
            else:
                stalwart.run_layers(
                    stalwart.Layers(blocks=[("a", lambda: nn.Linear(2, 2))],
                                    loss=torch.nn.functional.mse_loss),
                    stalwart.Data(torch.utils.data.TensorDataset(torch.zeros(4, 2),
                                                                 torch.zeros(4, 2)),
                                  global_batch=2), steps=1)
    finally:
        dist.destroy_process_group()


def test_a_second_loop_over_ctx_steps_is_refused():
    # The end of the first loop would be the job's last step: its commit completes the
    # job. Phases go inside one loop.
    from stalwart.client.user_loop import Context

    ctx = Context(None, program=None, start=0)  # type: ignore[arg-type]
    assert list(ctx.steps(0)) == []
    with pytest.raises(RuntimeError, match=r"ctx.steps\(\) was called again.*choose each "
                                           r"phase .* by the step index"):
        next(ctx.steps(5))


def test_run_refuses_state_without_load_state_dict_before_starting():
    class Counter:
        def state_dict(self):
            return {"n": 1}

    model = nn.Linear(2, 2)
    with pytest.raises(stalwart.StateError, match=r"'counter' \(Counter\) has no "
                                                  r"load_state_dict\(\)"):
        stalwart.run(lambda ctx: None, model=model,
                     optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                     state={"counter": Counter()})


def test_a_random_generator_of_the_scripts_own_is_state_and_restores_its_draws():
    import random

    import numpy as np

    gens = {"torch": torch.Generator().manual_seed(3), "python": random.Random(5),
            "pcg": np.random.default_rng(7), "mt": np.random.Generator(np.random.MT19937(9)),
            "philox": np.random.Generator(np.random.Philox(11))}

    def draws() -> list[Any]:
        return [torch.rand(3, generator=gens["torch"]).tolist(), gens["python"].gauss(0, 1),
                gens["pcg"].random(), gens["mt"].integers(1 << 30), gens["philox"].random()]

    draws()
    registry = StateRegistry(gens)
    tensors, extra = registry.capture(1)
    saved = {t.name: t.tensor.clone() for t in tensors}
    want = draws()
    registry.load(saved, json.loads(json.dumps(extra)))  # the record travels as JSON
    assert draws() == want
    with pytest.raises(stalwart.StateError, match=r"'os' is a random.SystemRandom: it draws "
                                                  r"from the operating system"):
        StateRegistry({"os": random.SystemRandom()})


def test_run_refuses_an_optimizer_that_is_not_a_torch_optimizer_before_starting():
    class Wrapper:  # a wrapper that only looks like one: its step() could not be hooked
        def __init__(self, inner: torch.optim.Optimizer) -> None:
            self.inner = inner

        def step(self) -> None:
            self.inner.step()

        def state_dict(self) -> dict[str, Any]:
            return self.inner.state_dict()

        def load_state_dict(self, sd: dict[str, Any]) -> None:
            self.inner.load_state_dict(sd)

    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"optimizer is a Wrapper, not a torch.optim.Optimizer"):
        stalwart.run(lambda ctx: None, model=model,
                     optimizer=Wrapper(torch.optim.SGD(model.parameters(), lr=0.1)))


def test_run_refuses_a_lazy_module_not_yet_run_before_starting():
    model = nn.Sequential(nn.LazyLinear(4), nn.ReLU(), nn.LazyLinear(2))
    with pytest.raises(stalwart.StateError, match=r"'model' has 4 uninitialized tensors "
                                                  r"\(0.weight, 0.bias, 2.weight, \.\.\.: "
                                                  r"a lazy module's\); run one forward"):
        stalwart.run(lambda ctx: None, model=model,
                     optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("entry", ["run", "run_layers"])
def test_a_cuda_device_where_torch_sees_none_is_refused_before_starting(entry):
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"device='cuda', but torch sees no CUDA device .*"
                                         r"use device='cpu'"):
        if entry == "run":
            stalwart.run(lambda ctx: None, model=model, device="cuda",
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        else:
            layers = stalwart.Layers(blocks=[("head", lambda: nn.Linear(2, 2))],
                                     loss=torch.nn.functional.mse_loss)
            stalwart.run_layers(layers, stalwart.Data(_Items(), global_batch=4), steps=1,
                                device="cuda")


def test_a_device_or_deadline_that_is_none_is_refused_before_starting():
    model = nn.Linear(2, 2)
    layers = stalwart.Layers(blocks=[("head", lambda: nn.Linear(2, 2))],
                             loss=torch.nn.functional.mse_loss)
    data = stalwart.Data(_Items(), global_batch=4)
    for kw, message in [({"device": "tpu"}, r"device='tpu' is not a torch device"),
                        ({"collective_timeout_s": 0}, r"collective_timeout_s=0; give the "),
                        ({"collective_timeout_s": float("inf")}, r"collective_timeout_s=inf")]:
        with pytest.raises(ValueError, match=message):
            stalwart.run(lambda ctx: None, model=model,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.1), **kw)
        with pytest.raises(ValueError, match=message):
            stalwart.run_layers(layers, data, steps=1, **kw)
    for steps in (0, -3, 2.5):
        with pytest.raises(ValueError, match=rf"steps={steps}; give the job's length"):
            stalwart.run_layers(layers, data, steps=steps)


def test_a_model_on_another_device_than_runs_is_refused_before_starting():
    model = nn.Linear(2, 2).to("meta")
    with pytest.raises(ValueError, match=r"parameters on meta but run\(device='cpu'\); move "
                                         r"the model to that device"):
        stalwart.run(lambda ctx: None, model=model,
                     optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


class _Items(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.full((2,), float(i)), torch.zeros(2)


def test_a_layout_the_data_cannot_take_fails_on_every_rank_before_anything_starts(
        monkeypatch):
    # No launcher is needed to hear it: the check comes before registering, so the job
    # never mistakes a rank that stops on it for a failed one.
    monkeypatch.delenv("STALWART_UNIX_SOCKET", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "6")
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="global batch 8 does not split over the job's 6 "
                                         "replicas"):
        stalwart.run(lambda ctx: None, model=model,
                     optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                     data=stalwart.Data(_Items(), global_batch=8))
    layers = stalwart.Layers(blocks=[(f"b{i}", lambda: nn.Linear(2, 2)) for i in range(4)],
                             loss=nn.functional.mse_loss)
    data = stalwart.Data(_Items(), global_batch=8)
    with pytest.raises(ValueError, match=r"does not split into dp=1 x grad_accum=1 x "
                                         r"microbatches=3.*microbatches=2 would"):
        stalwart.run_layers(layers, data, steps=2, pp=3, tp=2)
    with pytest.raises(ValueError, match="at most pp=4 stages"):
        stalwart.run_layers(layers, data, steps=2, pp=6, microbatches=2)
    # So does a training setting the ranks could not take.
    for setting, message in [({"precision": "fp8"}, r"precision='fp8'; choose one of \["),
                             ({"recompute": "all"}, r"recompute='all'; choose one of \["),
                             ({"compress": "int8"}, r"compress='int8'; choose one of \["),
                             ({"lr": float("nan")}, r"lr=nan; give a finite number of at least 0"),
                             ({"decay_steps": -1}, r"decay_steps=-1; give a finite number")]:
        with pytest.raises(ValueError, match=message):
            stalwart.run_layers(layers, data, steps=2, **setting)


class Ema:
    """A user object with tensors, tuples, non-finite floats and nested plain values."""

    def __init__(self) -> None:
        self.shadow = torch.zeros(3)
        self.meta = {"decay": 0.99, "best": float("inf"), "window": (1, 2), "tags": ["a"]}

    def state_dict(self):
        return {"shadow": self.shadow, "meta": self.meta}

    def load_state_dict(self, state):
        self.shadow = state["shadow"]
        self.meta = state["meta"]


def _job():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched, Ema()


def _train_a_step(model, opt, sched, ema) -> None:
    loss = model(torch.randn(16, 4)).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    sched.step()
    ema.shadow += 1


def _adamw(model: nn.Module, optimizer: str) -> tuple[torch.optim.Optimizer, Any]:
    # A tensor learning rate (as for a compiled step) makes every group's `lr` and
    # `initial_lr`, and the scheduler's `base_lrs`, tensors that the scheduler changes.
    lr = torch.tensor(1e-3) if optimizer == "adamw-tensor-lr" else 1e-3
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95))
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2)


def test_batches_of_something_other_than_data_are_refused_with_the_way_to_wrap_it():
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(4, 2)))
    ctx = object.__new__(stalwart.Context)
    with pytest.raises(TypeError, match=r"stalwart.Data, not DataLoader.*state=\{'loader'"):
        next(ctx.batches(loader))


@pytest.mark.parametrize("optimizer", ["sgd", "adamw", "adamw-tensor-lr"])
def test_registered_state_restores_bitwise_into_fresh_objects(optimizer):
    model, opt, sched, ema = _job()
    if optimizer != "sgd":
        opt, sched = _adamw(model, optimizer)
    for _ in range(3):
        _train_a_step(model, opt, sched, ema)
    registry = StateRegistry({"model": model, "optimizer": opt, "scheduler": sched, "ema": ema})
    tensors, extra = registry.capture(step=3)
    copies = {t.name: t.tensor.clone() for t in tensors}
    expected_rng = torch.get_rng_state()
    reference = [model.state_dict(), opt.state_dict(), sched.state_dict(), ema.state_dict()]

    model2, opt2, sched2, ema2 = _job()
    if optimizer != "sgd":
        opt2, sched2 = _adamw(model2, optimizer)
    torch.manual_seed(123)
    fresh = StateRegistry({"model": model2, "optimizer": opt2, "scheduler": sched2, "ema": ema2})
    assert fresh.load(copies, extra) == 3
    assert torch.equal(torch.get_rng_state(), expected_rng)
    for a, b in zip(reference, [model2.state_dict(), opt2.state_dict(), sched2.state_dict(),
                                ema2.state_dict()], strict=True):
        _assert_same(a, b)
    assert ema2.meta["window"] == (1, 2) and math.isinf(ema2.meta["best"])
    _train_a_step(model2, opt2, sched2, ema2)  # on the restored RNG: the same batch
    torch.set_rng_state(expected_rng)
    _train_a_step(model, opt, sched, ema)
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(p, q)


def test_gradients_are_averaged_in_buckets_of_consecutive_tensors_within_the_limit():
    from stalwart.client.grad_average import consecutive_buckets

    assert consecutive_buckets([4, 4, 4, 10, 1, 1], limit=8) == [[0, 1], [2], [3], [4, 5]]
    assert consecutive_buckets([3, 3], limit=100) == [[0, 1]]
    assert consecutive_buckets([], limit=8) == []


def test_a_grad_scaler_restored_in_its_process_forgets_the_step_a_failure_cut_short():
    model, opt, *_ = _job()
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=1)
    registry = StateRegistry({"model": model, "optimizer": opt, "scaler": scaler})
    tensors, extra = registry.capture(step=0)
    copies = {t.name: t.tensor.clone() for t in tensors}
    # The step the failure interrupts: unscaled, never stepped nor updated.
    scaler.scale(model(torch.randn(16, 4)).square().mean()).backward()
    scaler.unscale_(opt)
    assert registry.load(copies, extra) == 0
    opt.zero_grad()
    scaler.scale(model(torch.randn(16, 4)).square().mean()).backward()
    scaler.unscale_(opt)  # without the reset: "unscale_() has already been called"
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 512.0


def _assert_same(a, b) -> None:
    if torch.is_tensor(a):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a == b


def test_optimizer_state_is_keyed_by_parameter_name():
    model, opt, sched, ema = _job()
    _train_a_step(model, opt, sched, ema)
    tensors, extra = StateRegistry({"model": model, "optimizer": opt}).capture(step=1)
    names = {t.name for t in tensors}
    assert "optimizer/model/0.weight/momentum_buffer" in names
    assert extra["objects"]["optimizer"]["param_groups"][0]["params"][0] == "model/0.weight"


def test_only_tensors_the_optimizer_alone_changes_are_copied_beside_the_next_step():
    # A buffer changes in the next forward and another object's tensors whenever the
    # loop changes them: both are copied at the capture (`staged`), parameters and
    # optimizer state (changed only by optimizer.step()) beside the next step.
    model, opt, sched, ema = _job()
    _train_a_step(model, opt, sched, ema)
    tensors, _ = StateRegistry({"model": model, "optimizer": opt, "ema": ema}).capture(1)
    staged = {t.name for t in tensors if t.staged}
    assert staged == {"model/1.running_mean", "model/1.running_var",
                      "model/1.num_batches_tracked", "ema/shadow"}


def test_tensor_hyperparameters_of_an_optimizer_are_copied_at_the_capture():
    # The scheduler changes a tensor learning rate in place after optimizer.step().
    model, *_ = _job()
    opt, sched = _adamw(model, "adamw-tensor-lr")
    _train_a_step(model, opt, sched, Ema())
    tensors, extra = StateRegistry({"model": model, "optimizer": opt}).capture(1)
    staged = {t.name for t in tensors if t.staged}
    assert {"optimizer/param_groups/0/lr", "optimizer/param_groups/0/initial_lr"} <= staged
    assert extra["objects"]["optimizer"]["param_groups"][0]["lr"] == {
        "__stalwart_tensor__": "optimizer/param_groups/0/lr"}


def test_each_capture_reads_the_tensors_a_parameter_and_a_buffer_hold_now():
    model, opt, sched, ema = _job()
    _train_a_step(model, opt, sched, ema)
    registry = StateRegistry({"model": model, "optimizer": opt, "ema": ema})
    first, _ = registry.capture(step=1)
    weight, running = model[0].weight, model[1].running_mean
    with torch.no_grad():
        weight.data = torch.full_like(weight, 7.0)  # the same Parameter, other memory
        model[1].running_mean = torch.full_like(running, 3.0)  # another buffer object
        opt.state[model[3].bias]["momentum_buffer"] = torch.full_like(model[3].bias, 5.0)
    second, _ = registry.capture(step=2)
    now = {t.name: t.tensor for t in second}
    assert torch.equal(now["model/0.weight"], torch.full_like(weight, 7.0))
    assert torch.equal(now["model/1.running_mean"], torch.full_like(running, 3.0))
    assert torch.equal(now["optimizer/model/3.bias/momentum_buffer"],
                       torch.full_like(model[3].bias, 5.0))
    assert [t.name for t in first] == [t.name for t in second]


def test_a_captures_tensors_keep_reading_what_the_state_held_when_it_was_taken():
    """Until its copy is made (while the next step runs), a capture reads the memory its
    tensors had: a parameter whose `.data` is swapped meanwhile (an EMA swap for an
    evaluation) leaves the capture as it was."""
    model, opt, sched, ema = _job()
    _train_a_step(model, opt, sched, ema)
    registry = StateRegistry({"model": model, "optimizer": opt})
    registry.capture(step=1)
    taken, _ = registry.capture(step=2)  # reuses the first capture's views
    weight = model[0].weight
    held = weight.detach().clone()
    with torch.no_grad():
        weight.data = torch.full_like(weight, 9.0)
    assert torch.equal(next(t.tensor for t in taken if t.name == "model/0.weight"), held)


def test_state_dict_hooks_and_a_replaced_state_dict_get_what_state_dict_gives():
    model = nn.Linear(2, 2)
    seen = []
    model._register_state_dict_hook(  # noqa: SLF001 - the hook torch's own modules use
        lambda module, sd, prefix, meta: seen.extend(v.numpy().sum() for v in sd.values()))
    other = nn.Linear(2, 2)
    other.state_dict = lambda: {"w": other.weight.detach()}  # no keep_vars parameter
    opt = torch.optim.SGD([*model.parameters(), *other.parameters()], lr=0.1)
    tensors, _ = StateRegistry({"model": model, "other": other, "opt": opt}).capture(step=1)
    assert len(seen) == 2 and {"model/weight", "other/w"} <= {t.name for t in tensors}


def test_a_capture_of_unchanged_state_reuses_the_records_of_its_tensors():
    """The usual step: the same tensors under the same names. Their records are the last
    capture's objects (so their JSON need not be encoded again); a replaced tensor's
    record is new."""
    model, opt, sched, ema = _job()
    _train_a_step(model, opt, sched, ema)
    registry = StateRegistry({"model": model, "optimizer": opt})
    _, a = registry.capture(step=1)
    _train_a_step(model, opt, sched, ema)
    _, b = registry.capture(step=2)
    assert b["objects"]["model"] is a["objects"]["model"]
    state_a, state_b = a["objects"]["optimizer"]["state"], b["objects"]["optimizer"]["state"]
    assert all(state_b[name] is state_a[name] for name in state_a)
    opt.state[model[0].weight] = {"momentum_buffer": torch.zeros_like(model[0].weight),
                                  "extra": torch.zeros(1)}
    _, c = registry.capture(step=3)
    assert c["objects"]["optimizer"]["state"]["model/0.weight"] == {
        "momentum_buffer": {"__stalwart_tensor__": "optimizer/model/0.weight/momentum_buffer"},
        "extra": {"__stalwart_tensor__": "optimizer/model/0.weight/extra"}}
    assert c["objects"]["optimizer"]["state"]["model/3.bias"] is state_a["model/3.bias"]


def test_optimizer_state_that_is_not_all_tensors_is_read_again_at_every_capture():
    """A plain value in an optimizer's state (L-BFGS keeps counters there) may change
    in place of the same tensors: each capture records its value of the moment."""
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.state[model.weight] = {"calls": 1, "buffer": torch.zeros(2, 2)}
    registry = StateRegistry({"model": model, "optimizer": opt})
    _, a = registry.capture(step=1)
    opt.state[model.weight]["calls"] = 2
    tensors, b = registry.capture(step=2)
    assert a["objects"]["optimizer"]["state"]["model/weight"]["calls"] == 1
    assert b["objects"]["optimizer"]["state"]["model/weight"]["calls"] == 2
    assert "optimizer/model/weight/buffer" in {t.name for t in tensors}


def test_an_optimizer_whose_state_per_parameter_is_a_tensor_is_captured():
    class Momentum(torch.optim.Optimizer):
        def __init__(self, params) -> None:
            super().__init__(params, {"lr": 0.1})

        @torch.no_grad()
        def step(self) -> None:
            for group in self.param_groups:
                for p in group["params"]:
                    if not isinstance(self.state.get(p), torch.Tensor):
                        self.state[p] = torch.zeros_like(p)  # the state is the tensor
                    self.state[p].add_(p.grad)
                    p.sub_(group["lr"] * self.state[p])

    model = nn.Linear(3, 2)
    opt = Momentum(model.parameters())
    registry = StateRegistry({"model": model, "optimizer": opt})
    for step in (1, 2):
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
        tensors, _ = registry.capture(step)
        held = {t.name: t.tensor for t in tensors}
        assert torch.equal(held["optimizer/model/weight"], opt.state[model.weight])


def test_a_restore_leaves_no_old_optimizer_state_alive():
    """After an in-process restore the optimizer holds new tensors of the same layout:
    the registry must not keep the old ones (on a GPU, a second copy of the state)."""
    import json
    import weakref

    model = nn.Linear(8, 8)
    opt = torch.optim.Adam(model.parameters())
    registry = StateRegistry({"model": model, "optimizer": opt})

    def step() -> None:
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        opt.zero_grad()

    step()
    tensors, extra = registry.capture(1)
    old = weakref.ref(opt.state[model.weight]["exp_avg"])
    registry.load({t.name: t.tensor.clone() for t in tensors}, json.loads(json.dumps(extra)))
    del tensors
    for s in (2, 3):
        step()
        registry.capture(s)
    assert opt.state[model.weight]["exp_avg"] is not old() and old() is None


def test_adam_hints_name_the_parameters_and_moments():
    model = nn.Linear(3, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    hints = StateRegistry({"net": model, "opt": opt}).adamw_hints()
    assert {h.param for h in hints} == {"net/weight", "net/bias"}
    assert {h.exp_avg_sq for h in hints} == {"opt/net/weight/exp_avg_sq",
                                             "opt/net/bias/exp_avg_sq"}
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    assert StateRegistry({"net": model, "opt": sgd}).adamw_hints() == []


class Holder:
    def __init__(self, value) -> None:
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


@pytest.mark.parametrize("value,message", [
    (lambda: 1, r"'holder/value' is a function"),
    ({"inner": object()}, r"'holder/value/inner' is a object"),
    (torch.zeros(2, dtype=torch.complex64), r"'holder/value' has dtype torch.complex64"),
])
def test_state_that_cannot_be_captured_is_named(value, message):
    with pytest.raises(stalwart.StateError, match=message):
        StateRegistry({"holder": Holder(value)}).capture(step=1)


def test_state_whose_shape_changes_between_steps_is_refused():
    holder = Holder(torch.zeros(4))
    registry = StateRegistry({"holder": holder})
    registry.capture(step=1)
    holder.value = torch.zeros(5)
    with pytest.raises(stalwart.StateError, match=r"'holder/value' changed from \(4,\)"):
        registry.capture(step=2)


def test_an_optimizer_over_an_unregistered_module_is_refused():
    model, other = nn.Linear(2, 2), nn.Linear(2, 2)
    opt = torch.optim.SGD([*model.parameters(), *other.parameters()], lr=0.1)
    with pytest.raises(stalwart.StateError, match="no registered module"):
        StateRegistry({"model": model, "optimizer": opt}).capture(step=1)


def test_a_committed_step_without_a_registered_object_is_refused():
    tensors, extra = StateRegistry({"a": Holder(1)}).capture(step=1)
    with pytest.raises(stalwart.StateError, match=r"no state for \['b'\]"):
        StateRegistry({"a": Holder(1), "b": Holder(2)}).load(
            {t.name: t.tensor for t in tensors}, extra)


def test_layers_check_their_blocks_when_declared():
    with pytest.raises(ValueError, match="unique"):
        stalwart.Layers(blocks=[("a", nn.Identity), ("a", nn.Identity)], loss=None)
    with pytest.raises(TypeError, match="give a factory"):
        stalwart.Layers(blocks=[("a", nn.Identity())], loss=None)
    with pytest.raises(ValueError, match="one non-negative number per block"):
        stalwart.Layers(blocks=[("a", nn.Identity)], loss=None, costs=[1.0, 2.0])


def test_a_tp_plan_on_a_module_that_is_not_linear_is_named():
    from stalwart.client.layers import Stage

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(4)

    layers = stalwart.Layers(blocks=[("b", Block)], loss=None, tp_plan={"norm": "column"})
    with pytest.raises(TypeError, match="'norm' of block 'b' is a LayerNorm"):
        Stage(layers, 0, 0)


def test_param_digest_of_a_module_equals_that_of_its_hashes_in_any_order():
    from stalwart.client.digest import tensor_sha256

    model = nn.Linear(3, 2)
    hashes = {n: tensor_sha256(p) for n, p in model.named_parameters()}
    assert stalwart.param_digest(model) == stalwart.param_digest(dict(reversed(hashes.items())))
    with torch.no_grad():
        model.bias[0] += 1
    assert stalwart.param_digest(model) != stalwart.param_digest(hashes)
