"""`server.async_output` on this CPU, with the GPU's wait emulated (issue 23, the HTTP target).

On the H100 the server's decode steps at 32 streams took 1.6 ms more than the engine's
alone, about the event loop's CPU per step (1.9 ms), as if the loop's per-token work held
the GIL while each step launched. A tiny model's step here is all host work, so to show
the mechanism the sampler's read-back sleeps `--device-ms` before it reads (a wait on the
device: the GIL released, as `.tolist()` releases it while it copies from a GPU). The server is
the real one (uvicorn, the OpenAI routes, SSE) in this process; the client, bench http's
round (usage counted per chunk), runs in a subprocess so that its parsing does not take
the server's GIL. Off and on alternate, one server each; reported per round: the
server's mean decode step, its TPOT, the event loop's CPU per token.

    PYTHONPATH=. .venv/bin/python docs/serving-issue23/async_output_emulated.py [--streams 32] [--rounds 2]
"""

import argparse
import json
import subprocess
import sys
import time

from server.config import ServerConfig
from tests.servers import ServerThread, tiny_app

CLIENT = """
import json, sys
from bench.http import http_round, round_questions
print(json.dumps(http_round(sys.argv[1], round_questions(int(sys.argv[2]), int(sys.argv[3])), int(sys.argv[4]))))
"""


def with_device_wait(app, seconds: float) -> None:
    """Once the sampled ids are queued (and async_output has sent the step before's tokens),
    the wait a GPU's `.tolist()` would make."""
    sampler = app.state.alchemist.engine.engine.runner.sampler
    queued = sampler._queued

    def queued_then_waiting():
        queued()
        time.sleep(seconds)

    sampler._queued = queued_then_waiting


def run_round(url: str, streams: int, round_index: int, max_tokens: int) -> dict:
    out = subprocess.run([sys.executable, "-c", CLIENT, url, str(streams), str(round_index), str(max_tokens)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--device-ms", type=float, default=8.0)
    parser.add_argument("--json")
    args = parser.parse_args()
    results = {"off": [], "on": []}
    for round_index in range(args.rounds):
        for mode in ("off", "on") if round_index % 2 == 0 else ("on", "off"):
            app = tiny_app(server=ServerConfig(async_output=mode), max_num_seqs=args.streams, max_model_len=512,
                           kv_cache_bytes=64 << 20, max_num_batched_tokens=4096)
            with_device_wait(app, args.device_ms / 1000)
            with ServerThread(app) as server:
                run_round(server.url, args.streams, -1, 4)  # warm-up
                result = run_round(server.url, args.streams, round_index, args.max_tokens)
            results[mode].append(result)
            print(f"round {round_index + 1}  async_output {mode:<3}  decode step {1000 * result['decode_step_mean_s']:.2f} ms"
                  f"  server TPOT {1000 * result['server_tpot_mean_s']:.2f} ms  event loop "
                  f"{result['event_loop_cpu_ms_per_token']:.3f} ms CPU per token", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"streams": args.streams, "device_ms": args.device_ms, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
