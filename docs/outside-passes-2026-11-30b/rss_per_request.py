"""Sends N chat requests one after another to a live server and prints its RSS (with its children) and
activation cache every K requests: `python rss_per_request.py PORT PID N K`."""
import json, sys, time, urllib.request, psutil
port, pid, n, every = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
proc = psutil.Process(pid)
def rss():
    return sum(p.memory_info().rss for p in [proc] + proc.children(recursive=True)) / 2**20
def metric(name):
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    return [l for l in text.splitlines() if l.startswith(name)]
t0 = time.time()
for i in range(n):
    body = {"model": "SmolLM2-135M-Instruct", "max_tokens": 16, "temperature": 0,
            "messages": [{"role": "user", "content": f"Question {i}: tell me something about the number {i*7919} and the colour {i%13}."}]}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    urllib.request.urlopen(req).read()
    if (i + 1) % every == 0:
        cache = metric("alchemist:activation_cache_bytes") + metric("alchemist:activation_cache_ended_entries_total{state=\"evicted\"}")
        print(f"{i+1:5d} {time.time()-t0:6.1f}s rss {rss():8.1f} MiB  {cache[:2]}", flush=True)
