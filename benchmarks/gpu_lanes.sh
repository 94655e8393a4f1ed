#!/usr/bin/env bash
# Work for the GPUs of one machine that takes longer than one device call may run (600 s): one lane a GPU. Lane k
# (LANE_k, a shell command list) runs on GPU k in a process session of its own that outlives the call, its
# commands one after another; each call only watches, for at most WATCH seconds, then prints each lane's tail and
# packs the lanes' outputs and logs into $OUT/lanes.tgz (a call takes back 8 files).
#   call 1:   LANE_0="cmd; cmd" LANE_1="cmd" DETACH=1 WATCH=560 bash benchmarks/gpu_lanes.sh
#   call 2..: WATCH=560 bash benchmarks/gpu_lanes.sh      (within 30 s of the last: /tmp and /dev/shm stay only
#             while the machine is warm)
# A lane sees CUDA_VISIBLE_DEVICES=k and LANE_OUT=$STATE/lane_k (its outputs go there); its log is
# $STATE/lane_k.log, and $STATE/lane_k.done holds its exit status once it has ended. Set what every lane needs
# (NEUTRAIN_GIT_COMMIT, the carried wheels' PYTHONPATH) in the environment of call 1.
set -u
STATE=${STATE:-/tmp/neutrain-lanes}
WATCH=${WATCH:-0}
mkdir -p "$STATE"
if [ "${DETACH:-0}" = 1 ]; then
  for k in 0 1 2 3 4 5 6 7; do
    lane="LANE_$k"
    [ -n "${!lane-}" ] || continue
    mkdir -p "$STATE/lane_$k"
    rm -f "$STATE/lane_$k.done"
    CUDA_VISIBLE_DEVICES=$k LANE_OUT="$STATE/lane_$k" setsid nohup bash -c \
      "${!lane}; echo \"rc=\$? after \${SECONDS} s\" > '$STATE/lane_$k.done'" > "$STATE/lane_$k.log" 2>&1 < /dev/null &
    echo "lane $k started on GPU $k: ${!lane}"
  done
fi
until=$((SECONDS + WATCH))
while [ $SECONDS -lt $until ]; do
  running=0
  for log in "$STATE"/lane_*.log; do [ -f "${log%.log}.done" ] || running=1; done
  [ $running = 0 ] && break
  sleep 5
done
for log in "$STATE"/lane_*.log; do
  echo "== $(basename "$log" .log): $(cat "${log%.log}.done" 2>/dev/null || echo "still running")"
  grep -v "^WARNING\|^\s*$" "$log" | tail -n "${TAIL:-20}"
done
if [ -n "${OUT:-}" ]; then tar -czf "$OUT/lanes.tgz" -C "$STATE" . 2>/dev/null; fi
