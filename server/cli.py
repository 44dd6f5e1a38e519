"""The `alchemist` command: `serve`, `profile` and the benchmarks (`bench ...`).

Configuration comes from configs/default.toml, then `--config FILE`, then flags.
"""

from __future__ import annotations

import argparse
import logging
import sys

from engine.config import AlchemistConfig, load_config

logger = logging.getLogger("alchemist")


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML file layered over configs/default.toml")
    parser.add_argument("--model", help="local Hugging Face model directory (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--served-model-name", help="name clients use in the 'model' field")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--device", help="auto | cpu | cuda | cuda:N")
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--max-num-seqs", type=int)
    parser.add_argument("--max-num-batched-tokens", type=int)
    parser.add_argument("--kv-cache-bytes", type=int)
    parser.add_argument("--train-mode", choices=["off", "cpt", "dpo"], help="online training from served traffic")
    parser.add_argument("--learning-rate", type=float)
    parser.add_argument("--arbiter-policy", choices=["idle", "slo"], help="when training runs (default idle)")
    parser.add_argument("--tpot-slo-ms", type=float, help="time-per-output-token SLO for --arbiter-policy slo")
    parser.add_argument("--offload-device-budget-bytes", type=int, help="device bytes for recorded activations and "
                        "a serving step together; recorded layers are offloaded to fit (0: unlimited)")
    parser.add_argument("--offload-policy", choices=["hedged", "load", "recompute"],
                        help="how offloaded layers come back for training (default hedged)")
    parser.add_argument("--offload-profile", help="maps written by `alchemist profile --out FILE`")


def config_from_args(args: argparse.Namespace) -> AlchemistConfig:
    overrides = {
        "model": {"model": args.model, "served_model_name": args.served_model_name, "dtype": args.dtype,
                  "device": args.device, "max_model_len": args.max_model_len},
        "scheduler": {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens},
        "cache": {"kv_cache_bytes": args.kv_cache_bytes},
        "train": {"mode": getattr(args, "train_mode", None), "learning_rate": getattr(args, "learning_rate", None)},
        "arbiter": {"policy": getattr(args, "arbiter_policy", None), "tpot_slo_ms": getattr(args, "tpot_slo_ms", None)},
        "offload": {"device_budget_bytes": getattr(args, "offload_device_budget_bytes", None),
                    "policy": getattr(args, "offload_policy", None), "profile": getattr(args, "offload_profile", None)},
        "adapter": {"dir": getattr(args, "adapter_dir", None), "save_every": getattr(args, "adapter_save_every", None)},
        "server": {"host": getattr(args, "host", None), "port": getattr(args, "port", None),
                   "api_key": getattr(args, "api_key", None), "admin_key": getattr(args, "admin_key", None),
                   "max_queued_requests": getattr(args, "max_queued_requests", None),
                   "max_body_bytes": getattr(args, "max_body_bytes", None)},
    }
    return load_config(args.config, overrides)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="alchemist", description="OpenAI-compatible LLM server that learns "
                                     "online from what it serves.")
    parser.add_argument("--log-level", default="INFO")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the OpenAI-compatible server")
    _add_config_flags(serve)
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/* (or ALCHEMIST_SERVER_API_KEY, "
                       "which keeps the key out of the process list)")
    serve.add_argument("--admin-key", help="key for the adapter routes /v1/adapters* (or ALCHEMIST_SERVER_ADMIN_KEY)")
    serve.add_argument("--max-queued-requests", type=int,
                       help="requests waiting beyond --max-num-seqs running; more get 429 (default 256)")
    serve.add_argument("--max-body-bytes", type=int, help="larger request bodies get 413 (default 4 MiB)")
    serve.add_argument("--adapter-dir", help="save the adapter here (PEFT format) and resume from it on start")
    serve.add_argument("--adapter-save-every", type=int, help="save every N adapter versions (default 10)")

    bench = commands.add_parser("bench", help="benchmarks, each a side-by-side ratio in one run")
    benches = bench.add_subparsers(dest="bench", required=True)
    serving = benches.add_parser("serving", help="engine vs Hugging Face generate and generate_batch")
    _add_config_flags(serving)
    serving.add_argument("--num-prompts", type=int, default=8)
    serving.add_argument("--max-tokens", type=int, default=64)
    serving.add_argument("--repeats", type=int, default=3, help="interleaved rounds; medians are reported")
    serving.add_argument("--json", help="write the results to this JSON file")
    serving.add_argument("--with-adapter", action="store_true",
                         help="also serve with a LoRA adapter attached (what training mode costs serving)")
    training = benches.add_parser("training", help="reuse path vs recompute path on the embedded model")
    _add_config_flags(training)
    training.add_argument("--mode", choices=["cpt", "dpo"], required=True)
    training.add_argument("--tokens", type=int, default=512, help="trained tokens per entry")
    training.add_argument("--repeats", type=int, default=3)
    training.add_argument("--json", help="write the results to this JSON file")
    training.add_argument("--sweep", nargs="?", const="128,256,512,1024", default=None,
                          help="comma-separated token lengths (default 128,256,512,1024); draws PNG plots")
    training.add_argument("--plot-prefix", help="PNG path prefix (default bench-training-MODE)")
    colocate = benches.add_parser("colocate", help="serving latency with training off and on, over HTTP")
    colocate.add_argument("--policy", choices=["idle", "slo"], default="idle")
    colocate.add_argument("--rate", type=float, default=0.5, help="requests per second (Poisson)")
    colocate.add_argument("--seconds", type=float, default=60.0, help="trace length per run")
    colocate.add_argument("--tpot-slo-ms", type=float, default=100.0)
    colocate.add_argument("--rounds", type=int, default=2, help="off/on pairs, alternating")
    colocate.add_argument("--seed", type=int, default=0)
    colocate.add_argument("--train-config", help="TOML passed to the training-on server (e.g. record_fraction)")
    colocate.add_argument("--no-feedback", action="store_true",
                          help="record but send no feedback (isolates the cost of recording)")
    colocate.add_argument("--json", help="write the results to this JSON file")
    colocate.add_argument("--sweep", help="comma-separated rates; draws TPOT vs rate as PNG")
    colocate.add_argument("--plot", help="PNG path for --sweep (default bench-colocate-POLICY.png)")
    offload = benches.add_parser("offload", help="training with recorded layers kept, offloaded, recomputed, hedged")
    _add_config_flags(offload)
    offload.add_argument("--tokens", type=int, default=512, help="prompt tokens per entry (CPT)")
    offload.add_argument("--entries", type=int, default=3, help="entries cached together")
    offload.add_argument("--repeats", type=int, default=2)
    offload.add_argument("--budget-fraction", type=float, default=0.5,
                         help="device budget as a fraction of the entries' recorded activations")
    offload.add_argument("--json", help="write the report to this JSON file")
    offload.add_argument("--sweep", action="store_true", help="also sweep the freed fraction of layers and plot it")
    offload.add_argument("--plot", help="PNG path for --sweep (default bench-offload.png)")
    profile = commands.add_parser("profile", help="measure this device and write the offloading and hedging maps")
    _add_config_flags(profile)
    profile.add_argument("--out", required=True, help="JSON file to write (load it with --offload-profile)")
    profile.add_argument("--tokens", default="128,512,1024", help="token lengths to measure, comma-separated")
    soak = benches.add_parser("soak", help="mixed traffic with feedback for a while: errors, RSS growth, cache drain")
    soak.add_argument("--seconds", type=float, default=600.0, help="traffic duration")
    soak.add_argument("--rate", type=float, default=0.5, help="requests per second (Poisson)")
    soak.add_argument("--seed", type=int, default=0)
    soak.add_argument("--json", help="write the report (with the timeline) to this JSON file")
    soak.add_argument("--plot", help="PNG of RSS and activation cache over time (default bench-soak.png)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from engine.allocator import keep_freed_memory
    keep_freed_memory()
    if args.command == "bench" and args.bench in ("colocate", "soak"):
        config = None  # the bench starts its own servers
    else:
        try:
            config = config_from_args(args)
        except (ValueError, FileNotFoundError) as exc:
            print(f"alchemist: configuration error: {exc}", file=sys.stderr)
            return 2
    if args.command == "serve":
        from server.serve import build_server, run
        try:
            app = build_server(config)
        except ValueError as exc:  # what only the built server can judge (a saved adapter that does not fit)
            print(f"alchemist: configuration error: {exc}", file=sys.stderr)
            return 2
        run(app, config)
        return 0
    if args.command == "bench" and args.bench == "serving":
        from engine.bench_serving import run_serving_bench
        run_serving_bench(config, num_prompts=args.num_prompts, max_tokens=args.max_tokens,
                          repeats=args.repeats, json_path=args.json, with_adapter=args.with_adapter)
        return 0
    if args.command == "bench" and args.bench == "colocate":
        from server.bench_colocate import TrainingSide, run_colocate_bench
        sweep = [float(r) for r in args.sweep.split(",")] if args.sweep else None
        side = TrainingSide(args.policy, args.tpot_slo_ms, args.train_config, not args.no_feedback)
        run_colocate_bench(side, args.rate, args.seconds, args.rounds, args.seed, args.json, sweep, args.plot)
        return 0
    if args.command == "bench" and args.bench == "soak":
        from server.bench_soak import SoakConfig, run_soak_bench
        report = run_soak_bench(SoakConfig(seconds=args.seconds, rate=args.rate, seed=args.seed), args.json,
                                args.plot)
        return 0 if report["errors"] == 0 and report["cache_drained"] else 1
    if args.command == "profile":
        from offload.profile import run_profile
        run_profile(config, args.out, tuple(int(n) for n in args.tokens.split(",")))
        return 0
    if args.command == "bench" and args.bench == "offload":
        from offload.bench_offload import run_offload_bench
        run_offload_bench(config, args.tokens, args.entries, args.repeats, args.budget_fraction, args.json,
                          args.sweep, plot_path=args.plot)
        return 0
    if args.command == "bench" and args.bench == "training":
        from trainer.bench_training import run_training_bench
        sweep = [int(n) for n in args.sweep.split(",")] if args.sweep else None
        run_training_bench(config, args.mode, args.tokens, args.repeats, args.json, sweep, args.plot_prefix)
        return 0
    return 1


if __name__ == "__main__":
    sys.exit(main())
