#!/usr/bin/env bash
# Two replicas of the embedded model: the seconds from a start (model already converted) to
# the first /health answer, and from a `kill -9` of rank 1 to the next chat answered through
# the shared port. Run from the repository root with nothing else running.
set -u
PORT=${PORT:-8302}
DIR=$(mktemp -d)
.venv/bin/alchemist serve --data-parallel-size 2 --device cpu --train-mode dpo --adapter-dir "$DIR/adapters" \
    --adapter-save-every 1 --port "$PORT" > "$DIR/server.log" 2>&1 &
AGENT=$!
trap 'kill $AGENT 2>/dev/null; wait $AGENT 2>/dev/null; rm -rf "$DIR"' EXIT
chat() {
    curl -s -m 30 "localhost:$PORT/v1/chat/completions" -H 'content-type: application/json' \
        -d '{"model":"SmolLM2-135M-Instruct","messages":[{"role":"user","content":"Hi"}],"max_tokens":3}'
}
start=$(date +%s.%N)
until curl -s -m 2 "localhost:$PORT/health" > /dev/null; do sleep 1; done
echo "start: $(echo "$(date +%s.%N) - $start" | bc) s"
chat > /dev/null
sleep 3
for pid in $(pgrep -f "server.cli serve"); do
    if tr '\0' '\n' < "/proc/$pid/environ" 2>/dev/null | grep -q '^RANK=1$'; then RANK1=$pid; fi
done
killed=$(date +%s.%N)
kill -9 "$RANK1"
sleep 1
until chat | grep -q chatcmpl; do sleep 0.5; done
echo "back after kill -9 of rank 1: $(echo "$(date +%s.%N) - $killed" | bc) s"
