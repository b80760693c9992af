#!/bin/bash
# `make test` on fresh clones of one commit, one after another: QUIET runs on an idle
# machine, then BUSY runs with one core kept busy (`yes > /dev/null`). Each clone is a
# detached `git worktree` with its own .venv; a line per run goes to OUT/summary.txt.
#
#   scripts/fresh_clone_runs.sh [COMMIT] [QUIET] [BUSY] [OUT]   (defaults: HEAD 5 3 out/clones)
set -u
repo=$(git rev-parse --show-toplevel)
commit=$(git -C "$repo" rev-parse "${1:-HEAD}")
quiet=${2:-5}
busy=${3:-3}
out=$(realpath -m "${4:-$repo/out/clones}")
mkdir -p "$out"

run() {  # NAME HOG(0|1)
  local name=$1 hog=$2 dir
  dir=$(mktemp -d "/tmp/stalwart-clone-$name-XXXX")
  rmdir "$dir"
  git -C "$repo" worktree add -q --detach "$dir" "$commit"
  local hog_pid=""
  if [ "$hog" = 1 ]; then
    yes > /dev/null &
    hog_pid=$!
  fi
  local t0 rc t1
  t0=$(date +%s)
  (cd "$dir" && make test) > "$out/$name.log" 2>&1
  rc=$?
  t1=$(date +%s)
  if [ -n "$hog_pid" ]; then kill "$hog_pid"; fi
  echo "$name commit=${commit:0:7} busy=$hog rc=$rc seconds=$((t1 - t0))" \
       "$(grep -E '^[0-9]+ (passed|failed).* in [0-9.]+s' "$out/$name.log" | paste -sd ';')" >> "$out/summary.txt"
  git -C "$repo" worktree remove --force "$dir"
}

for i in $(seq 1 "$quiet"); do run "quiet$i" 0; done
for i in $(seq 1 "$busy"); do run "busy$i" 1; done
cat "$out/summary.txt"
