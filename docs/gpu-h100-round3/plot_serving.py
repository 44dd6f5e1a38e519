"""Draws the third GPU session's serving figures (H100, Llama-3.1-8B shape, bfloat16):
time per output token at 1 / 8 / 32 streams for the engine alone (gathered K/V and
FlexAttention) and over HTTP, beside issue 23's targets, vLLM's estimated figure and the
bandwidth limit. Reads the JSON beside it; writes serving-tpot.png.

    .venv/bin/python docs/gpu-h100-round3/plot_serving.py
"""

import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
from bench.report import pyplot, save_figure  # noqa: E402

HERE = pathlib.Path(__file__).parent
STREAMS = (1, 8, 32)
TARGETS_MS = (9, 11, 14)  # issue 23
VLLM_ESTIMATE_MS = 6.5  # its published 13 ms on an A100-40GB at the same share of the H100's bandwidth
BANDWIDTH_LIMIT_MS = 4.8  # 16 GB of weights read once per step


def main() -> None:
    http = json.loads((HERE / "http.json").read_text())["streams"]
    engine_ms = [1000 * http[str(n)]["engine"]["warm"]["tpot_mean_s"] for n in STREAMS]
    http_ms = [1000 * http[str(n)]["http"]["warm"]["tpot_mean_s"] for n in STREAMS]
    # the paged runs report tokens/s with the prefill; FlexAttention's TPOT is scaled from the engine's by their ratio
    flex_ratio = [json.loads((HERE / f"paged-16-{n}.json").read_text())["ratio_flex_over_engine"] for n in STREAMS]
    flex_ms = [ms / ratio for ms, ratio in zip(engine_ms, flex_ratio)]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(STREAMS, http_ms, "o-", color="tab:red", label="over HTTP (server and client TPOT agree)")
    ax.plot(STREAMS, engine_ms, "o-", color="tab:blue", label="engine alone, K/V gathered")
    ax.plot(STREAMS, flex_ms, "o--", color="tab:cyan", label="engine alone, FlexAttention (scaled by its ratio)")
    ax.plot(STREAMS, TARGETS_MS, "k:", marker="_", markersize=14, label="issue 23's targets")
    ax.axhline(VLLM_ESTIMATE_MS, color="tab:green", linestyle="--", label="vLLM at 1 stream, estimated")
    ax.axhline(BANDWIDTH_LIMIT_MS, color="gray", linestyle="-.", label="bandwidth limit at 1 stream")
    ax.set_xscale("log", base=2)
    ax.set_xticks(STREAMS, [str(n) for n in STREAMS])
    ax.set_ylim(0, max(http_ms) * 1.1)
    print(save_figure(fig, ax, "concurrent streams", "ms per output token (warm)",
                      "Serving on one H100, Llama-3.1-8B shape, bf16 (2026-11-25)", str(HERE / "serving-tpot.png")))


if __name__ == "__main__":
    main()
