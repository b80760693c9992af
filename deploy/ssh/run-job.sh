#!/usr/bin/env bash
# A protected training job over plain SSH: one `stalwart run` per host, each next to
# that host's running `stalwart daemon`; the hosts find each other through their
# daemons (their `peers` or etcd), not through a fixed MASTER_ADDR.
#
#   deploy/ssh/run-job.sh "host-a host-b" host-c -- examples/classifier/train.py --steps 1000
#
# The first argument lists the training hosts (node rank = position), the second the
# standby hosts holding only spares. The script must exist at the same path on every host.
set -euo pipefail

read -r -a hosts <<< "${1:?training hosts, e.g. \"host-a host-b\"}"
read -r -a standby <<< "${2-}"
shift 2
[ "${1-}" = "--" ] && shift
nproc=${NPROC_PER_NODE:-1}
spares=${SPARES_PER_NODE:-1}
nnodes=${#hosts[@]}

pids=()
for i in "${!hosts[@]}"; do
  ssh "${hosts[$i]}" stalwart run --nnodes "$nnodes" --node-rank "$i" \
    --nproc-per-node "$nproc" --spares "$spares" "$@" &
  pids+=("$!")
done
for host in "${standby[@]}"; do
  ssh "$host" stalwart run --nnodes "$nnodes" --nproc-per-node "$nproc" --standby "$@" &
  pids+=("$!")
done

# A lost host's launcher fails alone; the job's outcome is what the others report.
status=1
for pid in "${pids[@]}"; do
  if wait "$pid"; then status=0; fi
done
exit "$status"
