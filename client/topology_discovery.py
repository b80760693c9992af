"""Find the topology of the machine a rank runs on: NVML and `nvidia-smi topo -m` where a
GPU is present, else the configured (or default) topology. NVML (`nvidia-ml-py`) is an
optional import; nothing here needs it on a CPU machine.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess

from stalwart.core.topology import DEFAULT_INTRA, Link, Topology

__all__ = ["discover", "parse_topo_matrix"]

# Per link and direction, bytes/s, by NVLink generation (NVML reports the version).
_NVLINK_BW = {1: 20e9, 2: 25e9, 3: 25e9, 4: 25e9, 5: 50e9}
# Per lane, bytes/s, by PCIe generation (after line coding).
_PCIE_LANE_BW = {1: 0.25e9, 2: 0.5e9, 3: 0.985e9, 4: 1.969e9, 5: 3.938e9, 6: 7.563e9}
_NVLINK_LATENCY = 3e-6
_PCIE_LATENCY = 10e-6


def discover(configured: Topology | None = None, *, use_nvml: bool = True) -> Topology:
    """The topology of this job: GPUs and their links measured here, the rest configured.

    Node count and the inter-node link always come from `configured` (or from torchrun's
    WORLD_SIZE / LOCAL_WORLD_SIZE when none is given): one node cannot see the network.
    """
    base = configured or _from_env()
    if not use_nvml:
        return base
    local = _nvml_local()
    if local is None:
        return base
    devices, nvlink, pcie = local
    # NVLink counts only if every GPU pair uses it: one PCIe pair is the slow link of a ring
    matrix = _nvidia_smi_matrix()
    all_nvlink = all(kind.startswith("NV") for kind in matrix.values())
    intra = nvlink if nvlink is not None and all_nvlink else pcie
    return dataclasses.replace(base, devices_per_node=devices, intra=intra)


def _from_env() -> Topology:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    return Topology(nodes=max(1, world // max(1, local)), devices_per_node=max(1, local))


def _nvml_local() -> tuple[int, Link | None, Link] | None:
    """(GPU count, slowest NVLink or None, slowest PCIe link); None without NVML or GPUs."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        count = pynvml.nvmlDeviceGetCount()
        if count == 0:
            return None
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        nvlinks = [_nvlink(pynvml, h) for h in handles]
        pcie = min((_pcie(pynvml, h) for h in handles), key=lambda link: link.bandwidth)
        if any(link is None for link in nvlinks):
            return count, None, pcie
        return count, min(nvlinks, key=lambda link: link.bandwidth), pcie
    finally:
        pynvml.nvmlShutdown()


def _nvlink(pynvml, handle) -> Link | None:
    """Bandwidth over the device's active NVLinks; None when it has none."""
    nvlink = 0.0
    for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
        try:
            if pynvml.nvmlDeviceGetNvLinkState(handle, link) != pynvml.NVML_FEATURE_ENABLED:
                continue
            version = pynvml.nvmlDeviceGetNvLinkVersion(handle, link)
        except pynvml.NVMLError:
            break  # links are numbered densely; the first missing one ends the list
        nvlink += _NVLINK_BW.get(version, _NVLINK_BW[4])
    return Link(bandwidth=nvlink, latency=_NVLINK_LATENCY) if nvlink else None


def _pcie(pynvml, handle) -> Link:
    """The device's current PCIe link (generation x width)."""
    try:
        gen = pynvml.nvmlDeviceGetCurrPcieLinkGeneration(handle)
        width = pynvml.nvmlDeviceGetCurrPcieLinkWidth(handle)
    except pynvml.NVMLError:
        return DEFAULT_INTRA
    return Link(bandwidth=_PCIE_LANE_BW.get(gen, _PCIE_LANE_BW[4]) * width,
                latency=_PCIE_LATENCY)


def _nvidia_smi_matrix() -> dict[tuple[int, int], str]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {}
    try:
        done = subprocess.run([exe, "topo", "-m"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return parse_topo_matrix(done.stdout) if done.returncode == 0 else {}


def parse_topo_matrix(text: str) -> dict[tuple[int, int], str]:
    """GPU pairs (i < j) -> connection kind ("NV12", "PIX", "SYS", ...) from `topo -m`."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)  # nvidia-smi underlines the header
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        return {}
    header = lines[0].split("\t")
    columns = {i: int(m.group(1)) for i, name in enumerate(header)
               if (m := re.fullmatch(r"\s*GPU(\d+)\s*", name))}
    matrix: dict[tuple[int, int], str] = {}
    for line in lines[1:]:
        cells = line.split("\t")
        row = re.fullmatch(r"\s*GPU(\d+)\s*", cells[0])
        if row is None:
            continue
        i = int(row.group(1))
        for col, j in columns.items():
            if col < len(cells) and i < j:
                matrix[(i, j)] = cells[col].strip()
    return matrix
