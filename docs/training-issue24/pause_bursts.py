"""Bursts of three labelled chat requests two seconds apart, each burst after a 13 s pause
in traffic (longer than the trainer's 10 s quiet period), against a running DPO server:
the page faults of each request's recorded prefill (`alchemist:serving_step_page_faults_total`)
and the server's trims (`alchemist:memory_trims_total`). Run it against a server with
every pause giving freed memory back (`train.trim_slack_mib = 0`, the behaviour before
the slack) and one with the default slack:

    ALCHEMIST_TRAIN_TRIM_SLACK_MIB=0 .venv/bin/alchemist serve --train-mode dpo --port 8031 &
    .venv/bin/python docs/training-issue24/pause_bursts.py --url http://127.0.0.1:8031
    (then the same with the server started without the variable)
"""

import argparse
import re
import statistics
import time

import httpx


def read(client: httpx.Client) -> dict[str, float]:
    out = {}
    for line in client.get("/metrics").text.splitlines():
        if line.startswith('alchemist:serving_step_page_faults_total{kind="recorded_prefill"'):
            out["faults"] = float(line.split()[-1])
        elif line.startswith("alchemist:memory_trims_total"):
            out["trims"] = float(line.split()[-1])
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", default="http://127.0.0.1:8031")
    parser.add_argument("--bursts", type=int, default=6)
    args = parser.parse_args()
    client = httpx.Client(base_url=args.url, timeout=120)
    model = client.get("/v1/models").json()["data"][0]["id"]
    after_pause, within_burst = [], []
    for burst in range(args.bursts):
        for j in range(3):
            time.sleep(2 if j else 13)
            before = read(client)
            reply = client.post("/v1/chat/completions", json={"model": model, "max_tokens": 8, "messages": [
                {"role": "user", "content": f"Burst {burst}, request {j}: explain why the sky is blue in two "
                                            "sentences, plainly, for a child."}]}).json()
            after = read(client)
            client.post("/v1/feedback", json={"id": reply["id"], "chosen": "A kind answer.", "rejected": "A bad one."})
            faults = after["faults"] - before["faults"]
            if burst:  # the first burst warms the server up
                (after_pause if j == 0 else within_burst).append(faults)
            print(f"burst {burst} request {j}: {faults:6.0f} page faults; trims so far {after['trims']:.0f}", flush=True)
    print(f"median page faults of a recorded prefill: after a pause {statistics.median(after_pause):.0f}, "
          f"within a burst {statistics.median(within_burst):.0f}")


if __name__ == "__main__":
    main()
