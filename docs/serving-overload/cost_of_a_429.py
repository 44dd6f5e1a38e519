"""CPU per 429 answered while the server is full (the guard's count of sequences held set
to its limit, so nothing else runs), against a /health probe's, over one keep-alive
client in this process; 5 alternating rounds."""
import json, os, sys
import httpx
sys.path.insert(0, os.getcwd())
from server.config import ServerConfig
from server.guards import RequestGuard
from tests.servers import TINY_NAME, ServerThread, tiny_app

def cpu():
    t = os.times(); return t.user + t.system

app = tiny_app(max_num_seqs=1, server=ServerConfig(max_queued_requests=0))
with ServerThread(app) as server:
    layer = app.middleware_stack
    while not isinstance(layer, RequestGuard):
        layer = layer.app
    layer.in_flight = layer.config.max_in_flight
    body = {"model": TINY_NAME, "messages": [{"role": "user", "content": "hello " * 10}], "max_tokens": 20,
            "response_format": {"type": "json_object"}}
    per_429, per_health, n = [], [], 300
    with httpx.Client(timeout=60) as c:
        for _ in range(5):
            t0 = cpu()
            statuses = {c.post(f"{server.url}/v1/chat/completions", json=body).status_code for _ in range(n)}
            t1 = cpu()
            for _ in range(n):
                c.get(f"{server.url}/health")
            t2 = cpu()
            assert statuses == {429}, statuses
            per_429.append((t1 - t0) / n * 1e3); per_health.append((t2 - t1) / n * 1e3)
    per_429.sort(); per_health.sort()
    print(json.dumps({"cpu_ms_per_429": round(per_429[2], 3), "cpu_ms_per_health": round(per_health[2], 3),
                      "ratio": round(per_429[2] / per_health[2], 3)}))
