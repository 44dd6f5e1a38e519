#!/bin/bash
# The GRPO learning check over HTTP (examples/learn_from_rewards.py) at sampling temperatures
# 0.5 and 0.7, for 8 and 24 questions, on the tree before GRPO's log-probs took the sampling
# temperature ($BEFORE, a worktree of 81893de) and on this one, each run on a fresh server.
# Run from the repository root: BEFORE=/tmp/wt-before bash docs/grpo-temperature/learning_by_temperature.sh
set -u
ROOT=$(pwd)
run() {
  local dir=$1 port=$2 T=$3 rounds=$4 tag=$5
  (cd "$dir" && nohup "$ROOT/.venv/bin/python" -m server.cli serve --train-mode grpo --learning-rate 1e-3 \
     --port "$port" > "/tmp/learn-server-$tag.log" 2>&1 &)
  for _ in $(seq 120); do curl -sf "localhost:$port/health" > /dev/null && break; sleep 1; done
  timeout 1200 "$ROOT/.venv/bin/python" "$ROOT/examples/learn_from_rewards.py" --url "http://127.0.0.1:$port" \
    --rounds "$rounds" --temperature "$T" > "docs/grpo-temperature/learn-$tag.txt" 2>&1
  pkill -f "serve --train-mode grpo --learning-rate 1e-3 --port $port"; sleep 3
  echo "$tag: $(grep -h 'before:\|trained\|after:' "docs/grpo-temperature/learn-$tag.txt" | tr -s ' ' | tr '\n' ' ')"
}
for T in 0.5 0.7; do for rounds in 8 24; do
  run "$BEFORE" 19801 "$T" "$rounds" "before-T$T-r$rounds"
  run "$ROOT" 19802 "$T" "$rounds" "after-T$T-r$rounds"
done; done
