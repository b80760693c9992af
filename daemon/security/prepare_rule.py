"""The prepare rule: a daemon prepares only its own ranks of the coordinator's plan, in
the plan's layout, near the last commit, without taking the steps awaiting commit past a
bound.

The coordinator checks it for every prepare of every step (2,048 of them a step at
2,048 nodes), so what depends only on the plan is derived once per plan
(`ranks_by_node`, `seats_of`), what depends only on the moment once per batch (a
`PrepareRule`), and what a column of the commit tree shares (step, generation, layout,
final flag) once per column. A relayed seal of exactly its node's ranks then costs a lookup, a
comparison of bytes and its tag; any other seal is parsed and checked field by field.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Collection, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from stalwart.core import step_record as sr
from stalwart.core import wire
from stalwart.core.decide import PlanState
from stalwart.daemon.errors import NotReady
from stalwart.daemon.recovery.step_commits import Prepared
from stalwart.daemon.rpc import validate
from stalwart.daemon.rpc.errors import TYPED
from stalwart.daemon.security.auth import Forbidden
from stalwart.daemon.snapshot import commit_tree
from stalwart.daemon.snapshot.commit_tree import RelayKeys
from stalwart.v1 import common_pb2, manifest_pb2, peer_pb2

log = logging.getLogger("stalwart.daemon.security.prepare_rule")

MAX_STEPS_AHEAD = 10_000   # a prepare may be at most this many steps past the last commit
MAX_PENDING_STEPS = 256    # steps prepared but not yet committed, at most


def ranks_by_node(plan: PlanState) -> dict[str, frozenset[int]]:
    """Node -> the global ranks the plan puts on it."""
    placed: dict[str, set[int]] = {}
    for m in plan.members:
        if m.coord is not None:
            placed.setdefault(m.node, set()).add(m.coord.rank)
    return {node: frozenset(ranks) for node, ranks in placed.items()}


# A seal's digest field holding one sha256, as every daemon writes it after its ranks
_DIGEST_KEY = wire.tag(manifest_pb2.RankSeal.DESCRIPTOR, "digest") + wire.varint(32)
_DIGEST_FIELD = len(_DIGEST_KEY) + 32


@dataclass(frozen=True, slots=True)
class Seat:
    """A node's place in the plan as its relayed seals are checked: the bytes a seal of
    exactly its ranks starts with (its node and ranks fields, as a daemon serialises
    them), the number of ranks and the first rank such a seal covers, and the length
    of such a seal with its sha256 and no bases (-1: a seat found by parsing)."""
    node: str
    prefix: bytes
    size: int
    first: int
    whole: int


def seats_of(ranks_of: Mapping[str, AbstractSet[int]]) -> dict[bytes, Seat]:
    """The node's name (UTF-8) -> its seat, for every node with ranks in the plan."""
    seats = {}
    for node, ranks in ranks_of.items():
        ordered = sorted(ranks)
        prefix = manifest_pb2.RankSeal(node=node, ranks=ordered).SerializeToString(
            deterministic=True)
        seats[node.encode()] = Seat(node, prefix, len(ordered), ordered[0],
                                    len(prefix) + _DIGEST_FIELD)
    return seats


_NODE_KEY = wire.tag(manifest_pb2.RankSeal.DESCRIPTOR, "node")[0]  # one byte


def _named(seal: bytes) -> bytes:
    """The node name a seal's bytes start with (its node field, under 128 bytes); b""
    when they do not start so, and the seal is then parsed."""
    return (seal[2:2 + seal[1]] if len(seal) > 1 and seal[0] == _NODE_KEY and seal[1] < 0x80
            else b"")


def _parse(seals: list[bytes]) -> list[manifest_pb2.RankSeal]:
    """Many seals' bytes as messages, in one parse."""
    return list(sr.holding(seals).seals)


@dataclass(frozen=True)
class PrepareRule:
    """The rule at one moment: the coordinator's plan (None before it has one), the last
    committed step, and the steps awaiting commit. `ranks_of` is `ranks_by_node(plan)`
    and `seats` `seats_of(ranks_of)` when the caller keeps them across batches."""
    plan: PlanState | None
    latest: int | None
    pending: Collection[int] = ()
    ranks_of: Mapping[str, AbstractSet[int]] | None = None
    seats: Mapping[bytes, Seat] | None = None

    def check(self, caller: str, req: peer_pb2.PrepareStepRequest) -> None:
        """Raise unless `caller` may prepare what `req` names: NotReady before a plan,
        Forbidden outside the caller's role. An older generation passes: the
        coordinator answers it with StaleGeneration."""
        if self._step_allowed(req.step, req.generation, req.layout):
            self._own_ranks(caller, req.seal.ranks)

    def _step_allowed(self, step: int, generation: int,
                      lay: common_pb2.ParallelLayout) -> bool:
        """Raise unless a prepare of `step` may be taken now; False for an older
        generation (whose ranks the plan no longer says)."""
        plan = self.plan
        if plan is None:
            raise NotReady(f"step {step} prepared before this daemon coordinates a plan")
        if generation > plan.generation:
            raise Forbidden(f"prepare of generation {generation} is ahead of the plan "
                            f"(generation {plan.generation})")
        if generation < plan.generation:
            return False
        floor = max(self.latest or 0, plan.resume_step)
        if step > floor + MAX_STEPS_AHEAD:
            raise Forbidden(f"step {step} is more than {MAX_STEPS_AHEAD} steps past the last "
                            f"committed step {floor}")
        if len(self.pending) >= MAX_PENDING_STEPS and step not in self.pending:
            raise Forbidden(f"{len(self.pending)} steps already await their commit; step "
                            f"{step} is refused until older ones commit or are skipped")
        want = plan.layout
        if lay.tp != want.tp or lay.pp != want.pp or lay.dp != want.dp:
            raise Forbidden(f"step {step} was captured in layout {lay.dp}x{lay.pp}x{lay.tp}, "
                            f"the plan's is {want.dp}x{want.pp}x{want.tp}")
        return True

    def _ranks_of(self) -> Mapping[str, AbstractSet[int]]:
        assert self.plan is not None
        return ranks_by_node(self.plan) if self.ranks_of is None else self.ranks_of

    def _own_ranks(self, caller: str, ranks: Collection[int]) -> None:
        if not self._ranks_of().get(caller, frozenset()).issuperset(ranks):
            self._misplaced(caller, ranks)

    def _misplaced(self, caller: str, ranks: Collection[int]) -> None:
        assert self.plan is not None
        where = {m.coord.rank: m.node for m in self.plan.members if m.coord is not None}
        rank = next(r for r in ranks if where.get(r) != caller)
        raise Forbidden(f"daemon {caller} prepared rank {rank}, which the plan of "
                        f"generation {self.plan.generation} places on "
                        f"{where.get(rank, 'no node')}; a daemon prepares its own ranks")

    def relayed(self, batch: peer_pb2.PrepareBatch, keys: RelayKeys, via: str
                ) -> list[Prepared]:
        """The seals of a batch that came up the commit tree through `via` which may be
        taken, one Prepared per column: each carries its own daemon's tag for its
        column, is well formed and within that daemon's role. A bad seal is logged and
        left, not its column; a column outside the rule (too far ahead, another layout,
        an older generation) is left whole."""
        taken = []
        for column in batch.columns:
            try:
                current = self._step_allowed(column.step, column.generation, column.layout)
            except (Forbidden, *TYPED) as exc:
                log.warning("relayed prepares refused", extra={
                    "via": via, "step": column.step, "prepares": len(column.seals),
                    "error": str(exc)})
                continue
            if not current:
                log.warning("relayed prepares of an older generation skipped", extra={
                    "via": via, "step": column.step, "generation": column.generation})
                continue
            if (p := self._open(batch.job_id, column, keys, via)).seals:
                taken.append(p)
        return taken

    def _open(self, job_id: str, column: peer_pb2.SealColumn, keys: RelayKeys, via: str
              ) -> Prepared:
        step, width = column.step, commit_tree.TAG_BYTES
        identity = commit_tree.column_identity(job_id, step, column.generation,
                                               column.layout, column.final)
        seats = seats_of(self._ranks_of()) if self.seats is None else self.seats
        key_for, tag = keys.key_for, commit_tree.tagger(identity)
        seals = list(column.seals)
        at, chosen, made = [], [], []  # per seal that has a seat: its index, seat, tag
        deep = []  # positions in `chosen` of seals with more than node, ranks and digest
        for i, seal in enumerate(seals):
            seat = seats.get(_named(seal))
            if seat is None or not seal.startswith(seat.prefix):
                try:
                    seat = self._seat_of(seal)
                except (DecodeError, validate.InvalidRequest, Forbidden) as exc:
                    self._refused(via, step, seal, str(exc))
                    continue
            if (len(seal) != seat.whole
                    or not seal.startswith(_DIGEST_KEY, seat.whole - _DIGEST_FIELD)):
                deep.append(len(chosen))
            at.append(i)
            chosen.append(seat)
            made.append(tag(seal, key=key_for(seat.node)).digest())
        tags = column.tags
        if len(at) == len(seals) and hmac.compare_digest(b"".join(made), tags):
            good = list(range(len(at)))
        else:
            good = []
            for j, i in enumerate(at):
                if hmac.compare_digest(made[j], tags[i * width:(i + 1) * width]):
                    good.append(j)
                else:
                    self._refused(via, step, seals[i], "its tag is not its daemon's for "
                                  "this step: it was altered, moved or forged on the way")
        oldest = [step] * len(at)
        if deep:
            good = self._check_deep(via, step, [seals[i] for i in at], chosen, deep, good,
                                    oldest)
        return Prepared(step, column.generation, column.layout, column.final,
                        [chosen[j].node for j in good], [chosen[j].size for j in good],
                        [chosen[j].first for j in good], [seals[at[j]] for j in good],
                        [oldest[j] for j in good])

    def _check_deep(self, via: str, step: int, seals: list[bytes], seats: list[Seat],
                    deep: list[int], good: list[int], oldest: list[int]) -> list[int]:
        """Of `good` (positions in `seals`), those whose seals in `deep` hold exactly
        their seat's node and ranks, one sha256 and bases before `step`, parsed in one
        call; writes each one's oldest base into `oldest`. A seal of exactly node, ranks
        and digest as a daemon writes them needs none of this (its bytes say so)."""
        wanted = sorted(set(deep) & set(good))
        try:
            parsed = _parse([seals[j] for j in wanted])
        except DecodeError:  # one does not parse past its prefix: find which
            parsed = []
            for j in wanted:
                try:
                    parsed.append(manifest_pb2.RankSeal.FromString(seals[j]))
                except DecodeError as exc:
                    parsed.append(manifest_pb2.RankSeal())  # refused below: no node
                    self._refused(via, step, seals[j], f"it does not parse: {exc}")
        bad = set()
        for j, s in zip(wanted, parsed, strict=True):
            bases = s.bases
            if (s.node != seats[j].node or len(s.ranks) != seats[j].size
                    or len(s.digest) != 32 or (bases and max(bases) >= step)):
                bad.add(j)
                self._refused(via, step, seals[j], "its digest is not one sha256, its ranks "
                              "or node repeat, or it names a base not before its step")
            elif bases:
                oldest[j] = min(bases)
        return [j for j in good if j not in bad] if bad else good

    def _seat_of(self, data: bytes) -> Seat:
        """The seat of a seal that is not exactly its node's ranks (a subset, or bytes
        not as a daemon writes them): parsed and checked as a direct prepare's."""
        seal = manifest_pb2.RankSeal.FromString(data)
        validate.relayed_seal(seal)
        self._own_ranks(seal.node, seal.ranks)
        return Seat(seal.node, b"", len(seal.ranks), seal.ranks[0], -1)

    @staticmethod
    def _refused(via: str, step: int, seal: bytes, why: str) -> None:
        log.warning("relayed prepare refused", extra={
            "via": via, "step": step, "node": _named(seal).decode(errors="replace"),
            "error": why})
