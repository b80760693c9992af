"""Capture copies a rank's state into daemon slots off the training thread, bit for bit."""

import json
import os
import threading

import pytest
import torch

from stalwart.client.capture import Capturer
from stalwart.client.daemon_env import parse_cpus
from stalwart.client.state_layout import StateTensor, describe, unpack
from stalwart.daemon.snapshot.slots import FdServer, SlotPool


class LoopbackTransport:
    """The daemon's side of OpenSlot/Capture, in-process, over a real fd socket."""

    def __init__(self, pool: SlotPool, server: FdServer):
        self.pool, self.server = pool, server
        self.received: dict[int, tuple[bytes, list, dict]] = {}
        self.gate = threading.Event()
        self.gate.set()
        self.open_gate = threading.Event()  # cleared: OpenSlot waits, as on a busy daemon
        self.open_gate.set()
        self.opened_on: list[str] = []  # the thread of each OpenSlot
        self.opening = threading.Event()  # an OpenSlot has begun
        self.refuse_opens = 0  # this many OpenSlot calls fail first

    def open_slots(self, nbytes):
        self.opened_on.append(threading.current_thread().name)
        self.opening.set()
        assert self.open_gate.wait(timeout=30)
        if self.refuse_opens:
            self.refuse_opens -= 1
            raise ConnectionError("daemon unavailable")
        return [(s.slot_id, str(self.server.path)) for s in self.pool.open("rank-0", nbytes)]

    def send_capture(self, step, slot_id, metas, extra, hints=(), stall_s=0.0, final=False):
        assert self.gate.wait(timeout=30)
        slot = self.pool.get(slot_id)
        total = max(m.offset + m.nbytes for m in metas)
        self.received[step] = (bytes(slot.view[:total]), list(metas), json.loads(extra))


@pytest.fixture
def transport(tmp_path):
    pool = SlotPool(budget_bytes=64 << 20)
    server = FdServer(pool, tmp_path / "fd.sock")
    server.start()
    yield LoopbackTransport(pool, server)
    server.stop()
    pool.close()


def _state(seed: int) -> list[StateTensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        StateTensor("w", torch.randn(64, 33, generator=g), layer=0),
        StateTensor("b16", torch.randn(17, generator=g).to(torch.bfloat16), layer=1),
        StateTensor("step", torch.tensor([seed], dtype=torch.int64)),
        StateTensor("mask", torch.rand(9, generator=g) > 0.5),
    ]


def test_captured_bytes_restore_every_tensor_bitwise(transport):
    cap = Capturer(transport)
    for step in range(3):
        cap.capture(step, _state(step), {"data_position": step * 10})
    cap.close()
    for step in range(3):
        data, metas, extra = transport.received[step]
        restored = unpack(data, metas)
        for st in _state(step):
            got = restored[st.name]
            assert got.dtype == st.tensor.dtype and got.shape == st.tensor.shape
            assert torch.equal(got.view(torch.uint8), st.tensor.view(torch.uint8))
        assert extra == {"data_position": step * 10}


def test_a_state_whose_tensors_change_between_captures_is_laid_out_anew(transport):
    # The layout of one capture is reused by the next while names, dtypes and shapes
    # stay; an optimizer state that appears, or a tensor that changes shape, gets its own.
    g = torch.Generator().manual_seed(3)
    states = {0: _state(0),
              1: [*_state(1), StateTensor("exp_avg", torch.randn(64, 33, generator=g))],
              2: [StateTensor("w", torch.randn(64, 34, generator=g), layer=0), *_state(2)[1:]],
              3: _state(3)}
    cap = Capturer(transport)
    for step, state in states.items():
        cap.capture(step, state, {})
    cap.close()
    for step, state in states.items():
        data, metas, _ = transport.received[step]
        assert [m.name for m in metas] == [st.name for st in state]
        restored = unpack(data, metas)
        for st in state:
            assert restored[st.name].shape == st.tensor.shape
            assert torch.equal(restored[st.name].view(torch.uint8), st.tensor.view(torch.uint8))


def test_update_after_before_update_does_not_leak_into_the_snapshot(transport):
    cap = Capturer(transport)
    params = torch.ones(1000)
    cap.capture(7, [StateTensor("p", params)], {})
    cap.before_update()
    params.add_(1.0)  # the optimizer's next update
    cap.close()
    data, metas, _ = transport.received[7]
    assert torch.equal(unpack(data, metas)["p"], torch.ones(1000))


def test_slots_opened_ahead_open_off_the_training_thread_and_serve_the_first_capture(
        transport):
    # After a restore the first capture ends the recovery: its slots open meanwhile.
    cap = Capturer(transport)
    transport.open_gate.clear()  # the daemon is slow to make the slots
    cap.open_ahead(_state(0))  # returns while the daemon is still making them
    assert transport.opening.wait(timeout=30)
    assert transport.opened_on[0].startswith("stalwart-copy")  # the copier's thread
    transport.open_gate.set()
    cap.capture(5, _state(5), {})
    cap.close()
    assert len(transport.opened_on) == 1  # the capture used the slots opened ahead
    data, metas, _ = transport.received[5]
    restored = unpack(data, metas)
    for st in _state(5):
        assert torch.equal(restored[st.name].view(torch.uint8), st.tensor.view(torch.uint8))


def test_slots_that_failed_to_open_ahead_are_opened_by_the_capture(transport):
    transport.refuse_opens = 1
    cap = Capturer(transport)
    cap.open_ahead(_state(0))
    cap.capture(1, _state(1), {})
    cap.close()
    assert len(transport.opened_on) == 2 and 1 in transport.received
    transport.refuse_opens = 1
    cap = Capturer(transport)
    cap.capture(2, _state(2), {})  # no opening ahead: the copy opens them, and fails
    with pytest.raises(ConnectionError, match="daemon unavailable"):
        cap.before_update()  # where a failed copy reaches the training thread
    cap.close()


def test_the_first_capture_does_not_wait_for_slots_still_being_opened(transport):
    # The step that ends a recovery must not wait for a busy daemon to make its slots:
    # the copy waits for them, and training only in the next before_update.
    cap = Capturer(transport)
    transport.open_gate.clear()
    cap.open_ahead(_state(0))
    assert transport.opening.wait(timeout=30)
    returned = threading.Event()
    threading.Thread(target=lambda: (cap.capture(5, _state(5), {}), returned.set()),
                     daemon=True).start()
    assert returned.wait(timeout=30) and not transport.open_gate.is_set()
    transport.open_gate.set()
    cap.close()
    data, metas, _ = transport.received[5]
    assert len(transport.opened_on) == 1
    assert torch.equal(unpack(data, metas)["w"], _state(5)[0].tensor)


def test_a_slow_daemon_blocks_only_when_both_slots_are_in_use(transport):
    cap = Capturer(transport)
    transport.gate.clear()  # the daemon stops consuming slots
    cap.capture(0, _state(0), {})
    cap.before_update()
    cap.capture(1, _state(1), {})
    cap.before_update()  # second slot still free: no block
    cap.capture(2, _state(2), {})  # slot 0 is still held by the daemon
    assert not cap._copied.done()
    transport.gate.set()
    cap.close()
    assert sorted(transport.received) == [0, 1, 2]


def test_duplicate_names_are_refused():
    with pytest.raises(ValueError, match="appears twice"):
        describe([StateTensor("a", torch.zeros(1)), StateTensor("a", torch.zeros(2))])


def test_a_layout_is_the_same_only_while_every_name_dtype_shape_and_place_is():
    from stalwart.client.state_layout import same_layout

    w = torch.zeros(2, 3)
    last = [StateTensor("w", w), StateTensor("rng/cpu", torch.get_rng_state())]
    # The usual step: the same StateTensors, and a new RNG state of the same shape.
    assert same_layout([last[0], StateTensor("rng/cpu", torch.get_rng_state())], last)
    assert same_layout([StateTensor("w", torch.ones(2, 3)), last[1]], last)
    for other in (StateTensor("v", w), StateTensor("w", w.double()),
                  StateTensor("w", torch.zeros(3, 2)), StateTensor("w", w, layer=1),
                  StateTensor("w", w, global_shape=(4, 3), offsets=(0, 0))):
        assert not same_layout([other, last[1]], last)
    assert not same_layout(last[:1], last)


def test_offsets_are_aligned_for_every_dtype():
    metas, total = describe(_state(0))
    assert all(m.offset % 64 == 0 for m in metas)
    assert total >= sum(m.nbytes for m in metas)


def test_unpack_copies_each_tensor_out_of_any_buffer_into_memory_of_its_own() -> None:
    from stalwart.client.state_layout import pack_into

    tensors = [StateTensor("a", torch.arange(10, dtype=torch.float32)),
               StateTensor("rng/cpu", torch.get_rng_state()),
               StateTensor("b", torch.full((3, 4), 7, dtype=torch.bfloat16))]
    metas, nbytes = describe(tensors)
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    pack_into(buf, tensors, metas)
    data = bytearray(buf.numpy().tobytes())
    for given in (data, bytes(data), memoryview(data)):
        got = unpack(given, metas)
        for st in tensors:
            assert torch.equal(got[st.name], st.tensor)
    got = unpack(data, metas)
    data[metas[0].offset + 4:metas[0].offset + 8] = bytes(4)  # the buffer may be reused
    assert got["a"][1] == 1
    torch.set_rng_state(got["rng/cpu"])  # an API that wants a tensor of its own


def test_a_restore_slot_is_handed_out_once_and_one_never_fetched_expires() -> None:
    import os

    from stalwart.daemon.snapshot import slots
    from stalwart.daemon.snapshot.slots import SlotBudgetExceeded, UnknownSlot

    pool = SlotPool(budget_bytes=3 * 4096)
    once = pool.open_once("n/1", 100)
    slot, fd = pool.take_fd(once.slot_id)
    os.close(fd)
    with pytest.raises(UnknownSlot):  # a second caller, side by side or later
        pool.take_fd(once.slot_id)
    reusable = pool.open("n/2", 4096)[0]
    _, dup = pool.take_fd(reusable.slot_id)
    assert dup != reusable.fd  # a duplicate: the pool may close its own meanwhile
    os.close(dup)
    assert pool.used_bytes == 2 * 4096
    forgotten = pool.open_once("n/3", 4096)
    with pytest.raises(SlotBudgetExceeded):
        pool.open_once("n/4", 4096)  # the budget is full
    forgotten.created -= slots.ONCE_TTL_S + 1  # its rank never came for it
    pool.open_once("n/4", 4096)  # and it is dropped to make room
    with pytest.raises(UnknownSlot):
        pool.take_fd(forgotten.slot_id)
    pool.close()


def test_capture_threads_run_on_the_cpus_they_are_given(transport):
    # A host that gives its daemon cores gives the capture's copy and hand-over those
    # cores too; the training thread stays where it was.
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("this machine gives the process one CPU: nothing to pin apart")
    own = frozenset({allowed[-1]})
    cap = Capturer(transport, cpus=own)
    for step in range(3):
        cap.capture(step, _state(step), {})
    cap.drain()
    workers = [t for t in threading.enumerate()
               if t.name.startswith(("stalwart-copy", "stalwart-send"))]
    assert {t.name.split("_")[0] for t in workers} == {"stalwart-copy", "stalwart-send"}
    assert all(os.sched_getaffinity(t.native_id) == own for t in workers)
    assert os.sched_getaffinity(0) == set(allowed)
    cap.close()
    assert sorted(transport.received) == [0, 1, 2]


@pytest.mark.parametrize("text,cpus", [("", None), ("1", {1}), ("0,1", {0, 1}),
                                       (" 0-1 ", {0, 1})])
def test_capture_cpus_are_read_as_a_cpu_list(text, cpus):
    assert parse_cpus(text) == (None if cpus is None else frozenset(cpus))


@pytest.mark.parametrize("text,message", [("x", "give CPU numbers like"),
                                          ("1-", "give CPU numbers like"),
                                          ("3-1", "give CPU numbers like"),
                                          ("4096", "this machine has CPUs 0-")])
def test_a_wrong_capture_cpu_list_is_refused_naming_it(text, message):
    with pytest.raises(ValueError, match=message) as info:
        parse_cpus(text)
    assert "STALWART_CAPTURE_CPUS" in str(info.value)


def test_a_staged_tensor_is_captured_as_it_was_when_the_next_forward_changes_it(
        transport):
    # A module buffer (BatchNorm's running statistics) changes in the next forward, before
    # the optimizer step the copy must end by: it is copied at the capture itself.
    cap = Capturer(transport)
    transport.open_gate.clear()  # the copy waits for its slots to open
    weights, running = torch.ones(1000), torch.zeros(64)
    cap.capture(3, [StateTensor("w", weights), StateTensor("running", running, staged=True)],
                {})
    assert transport.opening.wait(timeout=30)  # the copy has not begun
    running.add_(1.0)  # the next forward's update
    transport.open_gate.set()
    cap.before_update()
    weights.add_(1.0)  # the next optimizer step's
    cap.capture(4, [StateTensor("w", weights), StateTensor("running", running, staged=True)],
                {})
    cap.close()
    third, fourth = (unpack(*transport.received[s][:2]) for s in (3, 4))
    assert torch.equal(third["running"], torch.zeros(64))
    assert torch.equal(third["w"], torch.ones(1000))
    assert torch.equal(fourth["running"], torch.ones(64))  # the staging copy is reused
    assert torch.equal(fourth["w"], torch.full((1000,), 2.0))
