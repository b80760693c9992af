#!/bin/bash
# `make test` on fresh clones of one commit, one after another: QUIET runs on an idle
# machine, then BUSY runs with one core kept busy (`yes > /dev/null`). Each clone is a
# detached `git worktree` with its own .venv; a line per run goes to OUT/summary.txt.
#
#   scripts/fresh_clone_runs.sh [COMMIT] [QUIET] [BUSY] [OUT]   (defaults: HEAD 5 3 out/clones)
#
# SIGTERM or SIGINT stops the series: the run in progress is ended (its whole process
# group), its worktree removed, and network namespaces its tests left are deleted.
set -u
repo=$(git rev-parse --show-toplevel)
commit=$(git -C "$repo" rev-parse "${1:-HEAD}")
quiet=${2:-5}
busy=${3:-3}
out=$(realpath -m "${4:-$repo/out/clones}")
mkdir -p "$out"

# The run in progress, for the clean-up a stopped series does (SIGTERM, SIGINT).
dir="" test_pid="" hog_pid=""

stop() {
  trap - TERM INT
  echo "stopped: ending the run in progress and cleaning up" >&2
  if [ -n "$test_pid" ]; then
    kill -TERM -- "-$test_pid" 2>/dev/null
    wait "$test_pid" 2>/dev/null
    kill -KILL -- "-$test_pid" 2>/dev/null  # what ignored the TERM
  fi
  if [ -n "$hog_pid" ]; then kill "$hog_pid" 2>/dev/null; fi
  # Network namespaces of multi-host tests whose process is gone (stwc-PID-*).
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep '^stwc-'); do
    pid=${ns#stwc-}
    pid=${pid%%-*}
    if ! kill -0 "$pid" 2>/dev/null; then ip netns del "$ns" 2>/dev/null; fi
  done
  if [ -n "$dir" ]; then git -C "$repo" worktree remove --force "$dir" 2>/dev/null; fi
  git -C "$repo" worktree prune
  exit 143
}
trap stop TERM INT

run() {  # NAME HOG(0|1)
  local name=$1 hog=$2
  dir=$(mktemp -d "/tmp/stalwart-clone-$name-XXXX")
  rmdir "$dir"
  git -C "$repo" worktree add -q --detach "$dir" "$commit"
  hog_pid=""
  if [ "$hog" = 1 ]; then
    yes > /dev/null &
    hog_pid=$!
  fi
  local t0 rc t1
  t0=$(date +%s)
  # In a process group of its own, so that a stop ends all of it.
  setsid bash -c 'cd "$1" && exec make test' _ "$dir" > "$out/$name.log" 2>&1 &
  test_pid=$!
  wait "$test_pid"
  rc=$?
  test_pid=""
  t1=$(date +%s)
  if [ -n "$hog_pid" ]; then kill "$hog_pid"; hog_pid=""; fi
  echo "$name commit=${commit:0:7} busy=$hog rc=$rc seconds=$((t1 - t0))" \
       "$(grep -E '^[0-9]+ (passed|failed).* in [0-9.]+s' "$out/$name.log" | paste -sd ';')" >> "$out/summary.txt"
  git -C "$repo" worktree remove --force "$dir"
  dir=""
}

for i in $(seq 1 "$quiet"); do run "quiet$i" 0; done
for i in $(seq 1 "$busy"); do run "busy$i" 1; done
cat "$out/summary.txt"
