"""Regenerate (or check) the committed protobuf and gRPC code from protos/.

    python scripts/gen_protos.py            # write generated files beside the .proto sources
    python scripts/gen_protos.py --check    # exit 1 if the committed files differ
"""

from __future__ import annotations

import argparse
import filecmp
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
PKG = PROTO_ROOT / "stalwart" / "v1"
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")


def generate(out: Path) -> list[Path]:
    from grpc_tools import protoc  # dev dependency, pinned in pyproject.toml

    # protoc finds the mypy plugins on PATH; they sit beside this interpreter.
    bindir = str(Path(sys.executable).parent)
    os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")

    sources = sorted(PKG.glob("*.proto"))
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{Path(protoc.__file__).parent / '_proto'}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        f"--mypy_out={out}",
        f"--mypy_grpc_out={out}",
        *[str(s) for s in sources],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed; see the messages above")
    return sorted(p for p in (out / "stalwart" / "v1").iterdir() if p.name.endswith(SUFFIXES))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--check", action="store_true", help="compare instead of writing")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        committed = sorted(p for p in PKG.iterdir() if p.name.endswith(SUFFIXES))
        if args.check:
            names = {p.name for p in fresh} ^ {p.name for p in committed}
            differ = [p.name for p in fresh if (PKG / p.name).exists()
                      and not filecmp.cmp(p, PKG / p.name, shallow=False)]
            if names or differ:
                print("generated protobuf code is out of date: "
                      f"{sorted(names | set(differ))}; run `make protos` and commit",
                      file=sys.stderr)
                return 1
            return 0
        for old in committed:
            old.unlink()
        for p in fresh:
            shutil.copy(p, PKG / p.name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
