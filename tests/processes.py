"""Finding a test's processes by what they were started with (no pid list needed)."""

from __future__ import annotations

import os
from pathlib import Path


def processes_naming(folder: Path) -> list[int]:
    """Live processes whose command line or environment names `folder`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            text = (entry / "cmdline").read_bytes() + (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if str(folder).encode() in text and state not in ("Z", "X"):
            found.append(int(entry.name))
    return found
