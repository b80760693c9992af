"""The physical shape of a cluster: nodes, devices per node, and the links between them.

Pure data, loaded from a TOML/JSON config (`load_topology`) or built in code.
Devices are numbered node-major: device d sits on node d // devices_per_node.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_INTER", "DEFAULT_INTRA", "Link", "Topology", "load_topology"]


@dataclass(frozen=True, kw_only=True)
class Link:
    """One kind of link between two devices."""

    bandwidth: float
    """Bytes per second one flow gets on this link when it has the link to itself."""
    latency: float
    """Seconds from send to first byte received (per message)."""

    def __post_init__(self) -> None:
        if self.bandwidth <= 0 or self.latency < 0:
            raise ValueError(f"a link needs bandwidth > 0 bytes/s and latency >= 0 s, "
                             f"got bandwidth={self.bandwidth}, latency={self.latency}")

    def transfer_s(self, nbytes: float) -> float:
        """Seconds to move one message of `nbytes` bytes over this link."""
        return self.latency + nbytes / self.bandwidth


# NVLink-class inside a node, a 200 Gb/s NIC between nodes: the usual ~10-20x gap.
DEFAULT_INTRA = Link(bandwidth=300e9, latency=3e-6)
DEFAULT_INTER = Link(bandwidth=25e9, latency=10e-6)


@dataclass(frozen=True, kw_only=True)
class Topology:
    """A cluster of identical nodes. Inter-node flows of one node share its NICs."""

    nodes: int
    """Number of nodes (hosts)."""
    devices_per_node: int
    """Accelerators (or CPU ranks) per node."""
    intra: Link = DEFAULT_INTRA
    """Link between two devices on the same node."""
    inter: Link = DEFAULT_INTER
    """Link between two devices on different nodes, per NIC."""
    nics_per_node: int = 1
    """Network interfaces per node; more concurrent inter-node flows share them."""
    node_names: tuple[str, ...] = field(default=())
    """Optional host names, one per node."""

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.devices_per_node < 1 or self.nics_per_node < 1:
            raise ValueError(f"a topology needs nodes, devices_per_node and nics_per_node >= 1, "
                             f"got {self.nodes}, {self.devices_per_node}, {self.nics_per_node}")
        if self.node_names and len(self.node_names) != self.nodes:
            raise ValueError(f"node_names lists {len(self.node_names)} names for "
                             f"{self.nodes} nodes; give one name per node or none")

    @property
    def devices(self) -> int:
        """Total number of devices in the cluster."""
        return self.nodes * self.devices_per_node

    def node_of(self, device: int) -> int:
        """Node index of a global device index."""
        if not 0 <= device < self.devices:
            raise ValueError(f"device {device} is outside this {self.nodes}x"
                             f"{self.devices_per_node} topology")
        return device // self.devices_per_node

    def link(self, a: int, b: int) -> Link:
        """The link a message from device `a` to device `b` travels over."""
        return self.intra if self.node_of(a) == self.node_of(b) else self.inter

    def inter_flow_bandwidth(self, flows: int) -> float:
        """Bytes/s each of `flows` concurrent inter-node flows leaving one node gets."""
        flows = max(1, flows)
        return self.inter.bandwidth * min(flows, self.nics_per_node) / flows

    def to_dict(self) -> dict[str, Any]:
        """A JSON/TOML-ready description (the inverse of `from_dict`)."""
        out = asdict(self)
        out["node_names"] = list(self.node_names)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Topology:
        """Build from a mapping such as a parsed `[topology]` config section."""
        known = {"nodes", "devices_per_node", "intra", "inter", "nics_per_node", "node_names"}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown topology keys {sorted(unknown)}; known: {sorted(known)}")
        kwargs: dict[str, Any] = {k: v for k, v in data.items() if k not in ("intra", "inter")}
        if "node_names" in kwargs:
            kwargs["node_names"] = tuple(kwargs["node_names"])
        for name in ("intra", "inter"):
            if name in data:
                kwargs[name] = Link(**data[name])
        return cls(**kwargs)


def load_topology(path: Path | str) -> Topology:
    """Read a topology from a .toml or .json file (a `[topology]` table or the top level)."""
    path = Path(path)
    text = path.read_text()
    if path.suffix == ".json":
        data = json.loads(text)
    elif path.suffix == ".toml":
        data = tomllib.loads(text)
    else:
        raise ValueError(f"{path}: topology files must end in .toml or .json")
    return Topology.from_dict(data.get("topology", data))
