#!/bin/bash
# The checks only a GPU machine can run, as one JSON of figures (`stalwart bench gpu`):
# capture stall of CUDA-resident state against DCP async_save with pinned memory,
# restore into CUDA tensors, NVML through the daemon's GPU monitor, an NCCL group
# aborted and rebuilt in-process.
#
#   scripts/gpu_check.sh [OUT.json]        on the GPU machine (default out/gpu_check.json)
#   scripts/gpu_check.sh --fetch-wheels    beforehand, where pip reaches an index: the
#                                          dependencies' wheels into .whl/ for a GPU
#                                          machine that reaches none
#
# On the GPU machine it uses python3's own CUDA build of torch: the repo goes into a
# virtual environment that sees the system's packages, its other dependencies from
# .whl/ when that folder exists, else from the package index.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
# The GPU machine's Python; its wheels must match it.
target_python=${STALWART_GPU_PYTHON_VERSION:-3.12}

dependencies() {  # the runtime requirements but torch and numpy (the GPU image has both)
  python3 - "$repo/pyproject.toml" <<'EOF'
import re, sys, tomllib
deps = tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]
print("\n".join(d for d in deps if re.split(r"[<>=\[ ]", d)[0] not in ("torch", "numpy")))
EOF
}

if [ "${1:-}" = "--fetch-wheels" ]; then
  mkdir -p "$repo/.whl"
  platforms=()
  for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 \
           manylinux2014_x86_64 manylinux1_x86_64; do platforms+=(--platform "$p"); done
  mapfile -t deps < <(dependencies)
  python3 -m pip download -q --only-binary=:all: --python-version "$target_python" \
    --implementation cp "${platforms[@]}" -d "$repo/.whl" "${deps[@]}" setuptools
  # The GPU image has these already; their wheels would only weigh on the transfer.
  rm -f "$repo"/.whl/numpy-*.whl "$repo"/.whl/torch-*.whl "$repo"/.whl/nvidia_*cu*.whl
  echo "$target_python" > "$repo/.whl/PYTHON_VERSION"
  du -sh "$repo/.whl"
  exit 0
fi

out=$(realpath -m "${1:-$repo/out/gpu_check.json}")
mkdir -p "$(dirname "$out")"
python3 - <<'EOF'
import sys, torch
if not torch.cuda.is_available():
    sys.exit(f"gpu_check: python3's torch {torch.__version__} sees no CUDA device; run this "
             "on a GPU machine (`stalwart bench gpu` runs a CPU smoke version anywhere)")
print(f"gpu_check: torch {torch.__version__}, {torch.cuda.get_device_name()}")
EOF
index=()
if [ -d "$repo/.whl" ]; then
  index=(--no-index --find-links "$repo/.whl")
  have=$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  wheels=$(cat "$repo/.whl/PYTHON_VERSION" 2>/dev/null || echo "$have")
  if [ "$have" != "$wheels" ]; then
    echo "gpu_check: .whl/ holds wheels for Python $wheels, this python3 is $have;" \
         "fetch them again with STALWART_GPU_PYTHON_VERSION=$have $0 --fetch-wheels" >&2
    exit 1
  fi
fi
venv=${STALWART_GPU_VENV:-/tmp/stalwart-gpu-venv}
pip=("$venv/bin/python" -m pip)
if ! python3 -m venv --system-site-packages "$venv" 2>/dev/null; then
  # A Debian python3 without its venv package has no ensurepip: the system's pip
  # installs into the environment instead (pip >= 22.3).
  python3 -m venv --system-site-packages --without-pip "$venv"
  pip=(python3 -m pip --python "$venv/bin/python")
fi
t0=$(date +%s)
"${pip[@]}" install -q "${index[@]}" "setuptools>=74.1"  # pyproject.toml's ext-modules table
"${pip[@]}" install -q --no-build-isolation "${index[@]}" -e "$repo"
echo "gpu_check: installed in $(( $(date +%s) - t0 )) s; running stalwart bench gpu"
# Well inside the 8 minutes a lent machine gives it: a stuck capture or collective
# ends the run with what it says, not the machine's lease.
if ! PYTHONUNBUFFERED=1 timeout "${STALWART_GPU_TIMEOUT_S:-420}" \
    "$venv/bin/stalwart" bench gpu --json "$out"; then
  echo "gpu_check: stalwart bench gpu did not finish (exit status above)" >&2
  exit 1
fi
cat "$out"
