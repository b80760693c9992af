"""Where a rank or tool on a daemon's node finds the job token.

`STALWART_TOKEN` when set; else the file the daemon keeps in its data dir
(`job.token`, mode 0600, so only the daemon's user reads it): next to the Unix
socket being dialled, or in `$STALWART_DATA_DIR`. See docs/security.md.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

TOKEN_FILE = "job.token"  # the daemon's name for it (stalwart.daemon.security.auth.TOKEN_FILE)


def find_token(target: str, env: Mapping[str, str] | None = None) -> str:
    """The job token for a daemon at `target` ("unix:PATH" or "HOST:PORT"), "" if none."""
    env = os.environ if env is None else env
    if env.get("STALWART_TOKEN"):
        return env["STALWART_TOKEN"]
    places = []
    if target.startswith("unix:"):
        places.append(Path(target.removeprefix("unix:")).parent)
    if env.get("STALWART_DATA_DIR"):
        places.append(Path(env["STALWART_DATA_DIR"]))
    for folder in places:
        try:
            return (folder / TOKEN_FILE).read_text().strip()
        except OSError:
            continue
    return ""
