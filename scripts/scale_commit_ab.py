"""The coordinator's CPU per committed step with N simulated daemons (`bench scale`'s
commit simulation): this tree's code against another revision's, alternated in one
script, each run in a fresh process.

    .venv/bin/python scripts/scale_commit_ab.py REV [DAEMONS] [RUNS]   # prints JSON

REV is checked out in a temporary git worktree and imported from there in place of this
tree (same interpreter and dependencies), so the protocol and the coordinator's code are
REV's while the machine, the load and the simulation's shape are the same.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class _Tree(importlib.abc.MetaPathFinder):
    """Imports `stalwart.*` from another checkout, by its pyproject's package-dir."""

    def __init__(self, root: Path) -> None:
        project = tomllib.loads((root / "pyproject.toml").read_text())
        dirs = project["tool"]["setuptools"]["package-dir"]
        self.dirs = {name: root / path for name, path in dirs.items()}

    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001 - the protocol's
        base = max((n for n in self.dirs if fullname == n or fullname.startswith(n + ".")),
                   key=len, default=None)
        if base is None:
            return None
        where = self.dirs[base].joinpath(*fullname[len(base):].split(".")[1:])
        if (where / "__init__.py").exists():
            return importlib.util.spec_from_file_location(
                fullname, where / "__init__.py", submodule_search_locations=[str(where)])
        if where.with_suffix(".py").exists():
            return importlib.util.spec_from_file_location(fullname, where.with_suffix(".py"))
        return None


def _run(root: Path, daemons: int, steps: int) -> float:
    """One simulation with the code of `root`; the coordinator's median CPU per step."""
    import asyncio

    from stalwart.bench import scale_commit

    assert Path(scale_commit.__file__).is_relative_to(root), scale_commit.__file__
    return asyncio.run(scale_commit._simulate(daemons, steps))["cpu"]  # noqa: SLF001


def main() -> None:
    rev = sys.argv[1]
    daemons = int(sys.argv[2]) if len(sys.argv) > 2 else 2048
    runs = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    out: dict[str, object] = {"daemons": daemons, "baseline": rev, "this_s": [],
                              "baseline_s": []}
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "baseline"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach",
                        str(old), rev], check=True)
        try:
            for _ in range(runs):
                for key, root in (("this_s", ROOT), ("baseline_s", old)):
                    got = subprocess.run(
                        [sys.executable, __file__, "--run", str(root), str(daemons)],
                        check=True, capture_output=True, text=True).stdout
                    out[key].append(round(float(got.split()[-1]), 4))  # type: ignore[union-attr]
                    print(key, out[key][-1], file=sys.stderr)  # type: ignore[index]
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                            str(old)], check=False)
    this, base = (statistics.median(out[k]) for k in ("this_s", "baseline_s"))  # type: ignore[arg-type]
    out["baseline_over_this"] = round(base / this, 2)
    print(json.dumps(out))


if len(sys.argv) > 2 and sys.argv[1] == "--run":
    # Here, at import, so that the simulation's spawned daemon processes (which import
    # this file as their main module) take the same tree.
    if Path(sys.argv[2]) != ROOT:
        sys.meta_path.insert(0, _Tree(Path(sys.argv[2])))
    if __name__ == "__main__":
        print(_run(Path(sys.argv[2]), int(sys.argv[3]), 4))
elif __name__ == "__main__":
    main()
