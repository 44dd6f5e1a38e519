"""Drives the colocate trace (0.25 req/s) at URL for SECONDS, with feedback if the third argument is 1."""
import asyncio, os, sys, json, statistics
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from bench.colocate import _run_trace
from bench.traces import make_trace
url, seconds, feedback = sys.argv[1], float(sys.argv[2]), sys.argv[3] == "1"
trace = make_trace(0.25, seconds, 0)
res = asyncio.run(_run_trace(url, trace, feedback, 0))
print(json.dumps({"n": len(res), "ttft_p50": statistics.median(r["ttft"] for r in res)}))
