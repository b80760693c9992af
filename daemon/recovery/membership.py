"""Which peer daemons this daemon knows, when it last heard from each, and who is lost.

A peer is keyed by the address it advertises (HOST:PORT). Configured addresses are
seeds: called until they answer (always, in a small job), possibly a DNS name standing
for several daemons, never a peer of their own. Liveness uses the same rule as ranks.

Up to `fanout` peers every daemon calls every other each interval, and only direct
contact (a Gossip call in either direction) refreshes a peer: addresses learnt second
hand are only added to the daemons to call. Past that a daemon
calls its RING live neighbours on each side of the ring of node names and a random
sample, `fanout` calls in all: only the neighbours are judged by the age of their last
contact (and only they report a peer lost), and every other peer's state comes second
hand. A reply whose caller's view differs carries the responder's table, each entry
with the peer's own clock at its last word (`time_unix_ms`) and whether it is lost; the
newer word wins, and a loss wins over life at the same word. A loss spreads through
the job in a few intervals, and a daemon makes `fanout` calls per interval however
large the job is.
"""

from __future__ import annotations

import asyncio
import bisect
import hashlib
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from stalwart.core.failures import Failure, FailureKind
from stalwart.daemon.metrics import Metrics
from stalwart.daemon.recovery.liveness import ALIVE, DEAD, LATE, heartbeat_state
from stalwart.v1 import peer_pb2

log = logging.getLogger("stalwart.daemon.recovery.membership")

UP, SUSPECT, LOST, UNKNOWN = "up", "suspect", "lost", "unknown"
RING = 2  # past `fanout` peers: neighbours on each side called every interval
MAX_AHEAD_MS = 60_000  # a second-hand word dated further ahead than this is ignored
_FROM_LIVENESS = {ALIVE: UP, LATE: SUSPECT, DEAD: LOST}


@dataclass
class _Watch:
    """The peers in one state, by node name, and waiters for one to enter it."""

    now: set[str] = field(default_factory=set)
    waiters: dict[str, asyncio.Event] = field(default_factory=dict)

    def enter(self, node: str) -> None:
        self.now.add(node)
        if (waiter := self.waiters.pop(node, None)) is not None:
            waiter.set()

    def leave(self, node: str) -> None:
        self.now.discard(node)

    async def until(self, node: str) -> None:
        if node not in self.now:
            await self.waiters.setdefault(node, asyncio.Event()).wait()


@dataclass
class PeerRecord:
    address: str
    node: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    generation: int = 0
    rank_ids: tuple[str, ...] = ()
    latest_committed: int = 0  # the newest step it had committed when last heard from
    last_seen: float | None = None  # membership clock; None = never reached
    heard_at: float | None = None  # membership clock of the last direct contact
    skew_ms: int = 0  # their wall clock minus ours at contact (for reporting only)
    state: str = UNKNOWN
    beat: int = 0  # its own wall clock (ms) at the newest word from it, direct or not


@dataclass
class Membership:
    """The peer table of one daemon."""

    self_node: str
    self_address: str
    interval_s: float
    timeout_s: float
    metrics: Metrics
    report: Callable[[Failure], Failure]
    clock: Callable[[], float] = time.monotonic
    wall: Callable[[], float] = time.time
    seeds: tuple[str, ...] = ()
    self_generation: Callable[[], int] = lambda: 0
    """This daemon's installed generation (the registry's)."""
    incumbent: Callable[[], str] = lambda: ""
    """The node that decided the installed plan ("" before the first plan)."""
    on_peer_up: Callable[[str], None] = lambda node: None
    """Called with a peer's node name when it answers again after being lost."""
    fanout: int = 0
    """Past this many peers, call neighbours and a sample each interval (0: all)."""
    rng: random.Random = field(default_factory=random.Random)
    _peers: dict[str, PeerRecord] = field(default_factory=dict)
    _answered: set[str] = field(default_factory=set)  # seeds that have replied once
    _last_check: float | None = None
    _resumed_at: float | None = None  # set after a pause until every live peer answered
    _view: bytes | None = None  # view(), until the daemons reached change
    _watched: set[str] = field(default_factory=set)  # sampled: the neighbours, by address
    _lost: _Watch = field(default_factory=_Watch)  # peers lost, by node name
    _silent: _Watch = field(default_factory=_Watch)  # suspect or lost

    def __post_init__(self) -> None:
        self._update_gauges()  # every state shows from the first scrape, at 0

    def addresses(self) -> list[str]:
        """Every daemon to call: each seed, then each peer not reached through one."""
        seeds = [a for a in self.seeds if a != self.self_address]
        return [*seeds, *(a for a in self._peers if a not in seeds)]

    def sampled(self) -> bool:
        """Whether the job is past `fanout` peers (see the module's docstring)."""
        return 0 < self.fanout < len(self._peers)

    def targets(self) -> list[str]:
        """Addresses to call Gossip on this interval: every daemon, or once sampled the
        seeds that never answered, the neighbours and a random sample."""
        if not self.sampled():
            return self.addresses()
        ring = self._neighbours()
        now = self.clock()
        for address in ring - self._watched:  # newly judged by age: a fresh grace period
            record = self._peers[address]
            if record.last_seen is not None:
                record.last_seen = max(record.last_seen, now)
        self._watched = ring
        rest = [a for a in self._peers if a not in ring]
        sample = self.rng.sample(rest, min(len(rest), max(0, self.fanout - len(ring))))
        unanswered = [a for a in self.seeds if a != self.self_address
                      and a not in self._answered and a not in self._peers]
        return [*unanswered, *sorted(ring), *sample]

    def _neighbours(self) -> set[str]:
        """The RING live peers on each side of this daemon on the ring of node names."""
        live = sorted((p.node, p.address) for p in self._peers.values()
                      if p.node and p.state in (UP, SUSPECT))
        if not live:
            return set()
        i = bisect.bisect_left(live, (self.self_node, ""))
        n = len(live)
        return ({live[(i + k) % n][1] for k in range(min(RING, n))}
                | {live[(i - 1 - k) % n][1] for k in range(min(RING, n))})

    def add_address(self, address: str) -> None:
        """Remember a daemon to gossip with (learnt second-hand)."""
        if address and address != self.self_address and address not in self._peers:
            self._peers[address] = PeerRecord(address)
            self._update_gauges()

    def observe(self, info: peer_pb2.PeerInfo) -> None:
        """Direct contact with a peer: refresh everything we know about it."""
        if not info.address or info.address == self.self_address or info.node == self.self_node:
            return
        self.add_address(info.address)
        record = self._peers[info.address]
        if record.state in (UNKNOWN, LOST):
            log.info("peer up", extra={"peer": info.node, "address": info.address})
        came_back = record.state == LOST
        if record.last_seen is None or came_back:
            self._view = None  # reached for the first time, or back
        record.beat = max(record.beat, info.time_unix_ms)
        record.node, record.labels = info.node, dict(info.labels)
        record.generation, record.rank_ids = info.generation, tuple(info.rank_ids)
        record.latest_committed = info.latest_committed
        record.last_seen = self.clock()
        self._move(record, UP)
        record.heard_at = record.last_seen
        record.skew_ms = info.time_unix_ms - int(self.wall() * 1000) if info.time_unix_ms else 0
        self._update_gauges()
        if came_back:
            self.on_peer_up(info.node)

    def learn(self, membership: peer_pb2.Membership, contacted: str) -> None:
        """A Gossip reply from `contacted`: its first entry is the responder, the rest hearsay."""
        self._answered.add(contacted)
        for i, info in enumerate(membership.peers):
            if i == 0:
                self.observe(info)
            elif self.sampled():
                self._hearsay(info)
            else:
                self.add_address(info.address)

    def _hearsay(self, info: peer_pb2.PeerInfo) -> None:
        """A peer's state as another daemon has it, taken when it is newer than ours (a
        neighbour's is judged by this daemon's own contact only)."""
        if not info.address or info.address == self.self_address or info.node == self.self_node:
            return
        self.add_address(info.address)
        record = self._peers[info.address]
        if info.address in self._watched:
            return
        lost = record.state == LOST
        if info.time_unix_ms > int(self.wall() * 1000) + MAX_AHEAD_MS:
            return  # dated further ahead than any clock skew: it would outrank every word
        if not (info.time_unix_ms > record.beat
                or (info.time_unix_ms == record.beat and info.lost and not lost)):
            return
        record.beat = info.time_unix_ms
        record.node = record.node or info.node
        record.labels = record.labels or dict(info.labels)
        record.generation = max(record.generation, info.generation)
        record.latest_committed = max(record.latest_committed, info.latest_committed)
        if info.lost and not lost:
            log.info("peer lost, as its neighbours tell", extra={"peer": record.node})
            self._view = None
            self._move(record, LOST)
        elif not info.lost:
            now = self.clock()
            if record.last_seen is None or lost:
                self._view = None
            record.last_seen = record.heard_at = now
            self._move(record, UP)
            if lost:
                log.info("peer up again, as its neighbours tell", extra={"peer": record.node})
                self.on_peer_up(record.node)
        self._update_gauges()

    def check(self) -> list[Failure]:
        """Move peers between up, suspect and lost; returns a failure per newly lost peer."""
        now, last = self.clock(), self._last_check
        self._last_check = now
        if last is not None and now - last > self.timeout_s:
            # This daemon was frozen (SIGSTOP, a stalled VM), not its peers: give every
            # peer a fresh grace period to answer instead of declaring them all lost.
            log.warning("this daemon was paused; re-learning who is alive",
                        extra={"paused_s": round(now - last, 3)})
            for record in self._peers.values():
                if record.last_seen is not None:
                    record.last_seen = max(record.last_seen, now - self.interval_s)
            self._resumed_at = now
            return []
        found = []
        sampled, changed = self.sampled(), False
        for record in self._peers.values():
            if record.last_seen is None:
                continue  # never reached
            if sampled and record.address not in self._watched:
                # Known second hand: up or lost as its neighbours tell. A suspicion from
                # when this daemon judged it by age (before the job grew past `fanout`,
                # or while it was a neighbour) would never clear: nothing here judges it
                # again, and the neighbours' word says only up or lost.
                if record.state == SUSPECT:
                    self._move(record, UP)
                    changed = True
                continue
            age = self.clock() - record.last_seen
            state = _FROM_LIVENESS[heartbeat_state(age, self.interval_s, self.timeout_s)]
            if state == record.state:
                continue
            if state == LOST:
                found.append(self.report(Failure(
                    FailureKind.PEER_LOST, record.node or record.address,
                    f"no contact with peer daemon {record.address} for {age:.2f} s",
                    generation=record.generation, reporter=self.self_node,
                    details={"silent_s": round(age, 3)})))
                # The loss as the peer's own clock would date it now (our clock plus its
                # skew): later than any word it said before it died, which a daemon that
                # heard from it after us may still pass on, and earlier than any word
                # it says if it comes back.
                record.beat = max(record.beat, int(self.wall() * 1000) + record.skew_ms)
                self._view = None
            self._move(record, state)
            changed = True
        if changed:
            self._update_gauges()
        return found

    def _move(self, record: PeerRecord, state: str) -> None:
        """A peer's new state; whoever waits for it to go quiet or lost is woken."""
        record.state = state
        node = record.node or record.address
        for watch, states in ((self._silent, (SUSPECT, LOST)), (self._lost, (LOST,))):
            if state in states:
                watch.enter(node)
            else:
                watch.leave(node)

    async def until_lost(self, node: str) -> None:
        """Until peer `node` is declared lost; at once if it is lost now. A call to a
        frozen peer waits out its deadline otherwise, though the peer is known lost."""
        await self._lost.until(node)

    def quiet(self, node: str) -> bool:
        """Whether peer `node` is suspect or lost now."""
        return node in self._silent.now

    async def until_silent(self, node: str) -> None:
        """Until peer `node` is suspect (a heartbeat overdue) or lost; at once if it is
        now. Work that has somewhere else to go (a shard, a record copy) stops waiting
        on a peer that has gone quiet, before it is declared lost."""
        await self._silent.until(node)

    def peers(self) -> list[PeerRecord]:
        """Known peers, plus (as "unknown") configured seeds that never answered."""
        silent = [PeerRecord(a) for a in self.seeds
                  if a not in self._answered and a not in self._peers and a != self.self_address]
        return sorted([*self._peers.values(), *silent], key=lambda p: (p.node or "~", p.address))

    def age_s(self, record: PeerRecord) -> float:
        """Seconds since direct contact, -1 if never reached."""
        return -1.0 if record.last_seen is None else max(0.0, self.clock() - record.last_seen)

    def view(self) -> bytes:
        """A digest of the daemons this one has reached, itself included, and which of
        them are lost: two daemons that see the job alike have the same view."""
        if self._view is None:
            reached = sorted([f"{self.self_address} up",
                              *(f"{p.address} {'lost' if p.state == LOST else 'up'}"
                                for p in self._peers.values() if p.last_seen is not None)])
            self._view = hashlib.sha256("\n".join(reached).encode()).digest()[:16]
        return self._view

    def to_proto(self, me: peer_pb2.PeerInfo, coordinator: str,
                 caller_view: bytes = b"") -> peer_pb2.Membership:
        """This daemon first, then every peer it has reached, unless the caller's view is
        this daemon's own (then it knows them all already: the reply stays one entry).
        Peers are hearsay to the receiver (it keeps only their addresses), so their rank
        ids stay out: a full reply grows with the number of daemons, not daemons x ranks."""
        if caller_view and caller_view == self.view():
            return peer_pb2.Membership(peers=[me], coordinator=coordinator,
                                       generation=me.generation)
        known = [peer_pb2.PeerInfo(node=p.node, address=p.address, labels=p.labels,
                                   generation=p.generation, time_unix_ms=p.beat,
                                   latest_committed=p.latest_committed, lost=p.state == LOST)
                 for p in self._peers.values() if p.last_seen is not None]
        return peer_pb2.Membership(peers=[me, *known], coordinator=coordinator,
                                   generation=me.generation)

    def by_rule(self) -> str:
        """The leader without etcd (see election.Leadership): the daemon that decided the
        installed plan while it lives, else the smallest eligible live node name."""
        live = [p for p in self._peers.values() if p.state in (UP, SUSPECT) and p.node]
        if self._resumed_at is not None and all(
                p.heard_at is not None and p.heard_at > self._resumed_at for p in live):
            self._resumed_at = None  # every live peer has answered since the pause
        # A daemon back from a pause, or behind the job's generation, never coordinates
        # until it has heard from its peers and installed the current plan.
        eligible = self._resumed_at is None and self.self_generation() >= max(
            (p.generation for p in live), default=0)
        names = {p.node for p in live}
        incumbent = self.incumbent()
        # Whoever decided the installed plan keeps the role while it lives (a smaller
        # name coming back does not take it over); else the smallest live name.
        if incumbent in names or (incumbent == self.self_node and eligible):
            return incumbent
        candidates = sorted(names | ({self.self_node} if eligible else set()))
        return candidates[0] if candidates else self.self_node

    def _update_gauges(self) -> None:
        counts = {UP: 0, SUSPECT: 0, LOST: 0, UNKNOWN: 0}
        for record in self._peers.values():
            counts[record.state] += 1
        for state, n in counts.items():
            self.metrics.peers.labels(state).set(n)
