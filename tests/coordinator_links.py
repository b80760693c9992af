"""Two daemons, n0 (the coordinator) and n1, as an in-process coordinator sees them: the
plans n0 was given and the steps n0 committed."""

from __future__ import annotations

from stalwart.v1 import common_pb2, peer_pb2


class Daemons:
    def __init__(self) -> None:
        self.plans: list[common_pb2.Plan] = []
        self.committed: list[int] = []
        self.hurried: list[tuple[str, int]] = []  # (node, step)
        self.holding = False  # what each daemon answers a hurry
        self.live = ["n0", "n1"]
        self.seated = True  # n0 holds the coordinator seat

    def nodes(self) -> list[str]:
        return self.live

    def holds_seat(self) -> bool:
        return self.seated

    async def install_plan(self, node: str, plan: common_pb2.Plan) -> None:
        if node == "n0":
            self.plans.append(plan)

    async def hurry_step(self, node: str, request: peer_pb2.HurryStepRequest) -> bool:
        self.hurried.append((node, request.step))
        return self.holding

    async def commit_step(self, node: str, request: peer_pb2.CommitStepRequest | bytes
                          ) -> None:
        if isinstance(request, bytes):
            request = peer_pb2.CommitStepRequest.FromString(request)
        if node == "n0":
            self.committed.append(request.record.step)
