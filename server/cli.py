"""The `alchemist` command: `serve`, `profile`, the benchmarks (`bench ...`) and the
feedback ledger (`feedback export|list|release`, server/feedback_cli.py).

Configuration comes from configs/default.toml, then `--config FILE`, then flags.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from engine.config import DECODE_ATTENTION
from server.config import AlchemistConfig, check_paths, load_config, refuse_a_key_left_unset, tokens_in
from server.feedback_cli import add_feedback_commands, feedback_command
from server.reasoning import REASONING_PARSERS
from trainer.config import TRAIN_MODES

logger = logging.getLogger("alchemist")


def token_count(text: str) -> int:
    """A length as vLLM's flags take it: 4096, 25.6k (1000s) or 32K (1024s, whole numbers only)."""
    try:
        return tokens_in(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def origins(text: str) -> tuple[str, ...]:
    """`--allowed-origins`: comma-separated, or a JSON list as vLLM's flag takes it."""
    if text.strip().startswith("["):
        try:
            listed = json.loads(text)
        except ValueError:
            listed = None
        if not (isinstance(listed, list) and all(isinstance(o, str) for o in listed)):
            raise argparse.ArgumentTypeError(f"not a JSON list of origins: {text!r}")
        return tuple(listed)
    return tuple(origin.strip() for origin in text.split(",") if origin.strip())


def lora_module(text: str) -> str:
    """`--lora-modules` as vLLM takes it: name=DIR, or {"name": …, "path": …} in JSON."""
    if not text.lstrip().startswith("{"):
        return text
    try:
        module = json.loads(text)
        return f"{module['name']}={module['path']}"
    except (ValueError, KeyError, TypeError):
        raise argparse.ArgumentTypeError(f"{text!r} is neither name=DIR nor a JSON object with \"name\" and "
                                         "\"path\"") from None


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML file layered over configs/default.toml")
    parser.add_argument("--model", help="local Hugging Face model directory (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--served-model-name", nargs="+", metavar="NAME",
                        help="name clients use in the 'model' field; several: each is accepted (as vLLM's)")
    parser.add_argument("--tokenizer", help="local tokenizer directory (default: the model's own)")
    parser.add_argument("--load-format", choices=["auto", "dummy"],
                        help="dummy: random weights from the model directory's config.json (benchmarks)")
    parser.add_argument("--generation-config", metavar="{auto,vllm,FOLDER}",
                        help="sampling defaults for what a request leaves out: auto, the model's generation config "
                        "(default; the embedded model's: temperature 0.2, top_p 0.9); vllm, OpenAI's (temperature 1, "
                        "top_p 1); or a folder holding a generation_config.json")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--device", help="auto | cpu | cuda | cuda:N")
    parser.add_argument("--max-model-len", type=token_count, help="prompt + completion tokens per sequence "
                        "(4096, 4k or 4K, as vLLM takes it)")
    parser.add_argument("--enforce-eager", action="store_const", const=True,
                        help="on a GPU, run the decode step eagerly instead of replaying CUDA graphs")
    parser.add_argument("--decode-attention", choices=list(DECODE_ATTENTION),
                        help="how decode rows read the KV cache: gather (copied out for SDPA), flex (read in place "
                        "by FlexAttention), or auto (the default: flex on a GPU, gather on the CPU)")
    parser.add_argument("--max-num-seqs", type=int)
    parser.add_argument("--max-num-batched-tokens", type=token_count)
    parser.add_argument("--kv-cache-bytes", type=int)
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                        help="reuse the K/V of prompts' shared beginnings across requests (default: on, as vLLM's)")
    parser.add_argument("--train-mode", choices=list(TRAIN_MODES), help="online training from served traffic")
    parser.add_argument("--learning-rate", type=float,
                        help="AdamW's rate per entry trained (default 1e-4; a step applies it times its entries)")
    parser.add_argument("--dpo-reference", choices=["base", "served"],
                        help="DPO's reference: the base model (default) or the adapter version that served the prompt")
    parser.add_argument("--reward-function", help="grpo: rewards computed in the server, 'package.module:function' "
                        "called with (prompt, responses) returning one number per response")
    parser.add_argument("--grpo-beta", type=float, help="grpo: weight of the KL to the base model (default 0)")
    parser.add_argument("--eval-set", help="JSONL probes: each new adapter version serves only once scored on them "
                        "without regressing (the eval gate; its labels are quarantined if it does)")
    parser.add_argument("--eval-tolerance", type=float, help="nats a probe kind's mean score may fall below the "
                        "last promoted version's (default 0.5)")
    parser.add_argument("--eval-max-kl", type=float, help="largest KL to the base model over recently trained "
                        "prompts a version may have (default 0: no bound)")
    parser.add_argument("--arbiter-policy", choices=["idle", "slo"], help="when training runs (default idle)")
    parser.add_argument("--tpot-slo-ms", type=float, help="time-per-output-token SLO for --arbiter-policy slo")
    parser.add_argument("--offload-device-budget-bytes", type=int, help="device bytes for recorded activations and "
                        "a serving step together; recorded layers are offloaded to fit (0: unlimited)")
    parser.add_argument("--offload-policy", choices=["hedged", "load", "recompute"],
                        help="how offloaded layers come back for training (default hedged)")
    parser.add_argument("--offload-profile", help="maps written by `alchemist profile --out FILE`")


def _model(args: argparse.Namespace) -> str | None:
    """--model, or `serve`'s positional MODEL (as `vllm serve MODEL`)."""
    positional = getattr(args, "model_tag", None)
    if positional and args.model and positional != args.model:
        raise ValueError(f"the model is given twice, as MODEL {positional!r} and --model {args.model!r}: give one")
    return args.model or positional


def _one_lora_module(args: argparse.Namespace) -> str | None:
    modules = getattr(args, "lora_modules", None)
    if modules and len(modules) > 1:
        raise ValueError(f"--lora-modules serves one adapter; got {len(modules)} ({', '.join(modules)})")
    return modules[0] if modules else None


def config_from_args(args: argparse.Namespace) -> AlchemistConfig:
    overrides = {
        "model": {"model": _model(args), "seed": getattr(args, "model_seed", None),
                  "served_model_name": ",".join(args.served_model_name or []) or None, "dtype": args.dtype,
                  "device": args.device, "max_model_len": args.max_model_len,
                  "enforce_eager": args.enforce_eager, "decode_attention": args.decode_attention,
                  "tokenizer": args.tokenizer, "load_format": args.load_format,
                  "generation_config": args.generation_config},
        "scheduler": {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens},
        "cache": {"kv_cache_bytes": args.kv_cache_bytes, "enable_prefix_caching": args.enable_prefix_caching},
        "train": {"mode": getattr(args, "train_mode", None), "learning_rate": getattr(args, "learning_rate", None),
                  "dpo_reference": getattr(args, "dpo_reference", None),
                  "reward_function": getattr(args, "reward_function", None),
                  "grpo_beta": getattr(args, "grpo_beta", None), "eval_set": getattr(args, "eval_set", None),
                  "eval_tolerance": getattr(args, "eval_tolerance", None),
                  "eval_max_kl": getattr(args, "eval_max_kl", None)},
        "arbiter": {"policy": getattr(args, "arbiter_policy", None), "tpot_slo_ms": getattr(args, "tpot_slo_ms", None)},
        "offload": {"device_budget_bytes": getattr(args, "offload_device_budget_bytes", None),
                    "policy": getattr(args, "offload_policy", None), "profile": getattr(args, "offload_profile", None)},
        "adapter": {"dir": getattr(args, "adapter_dir", None), "save_every": getattr(args, "adapter_save_every", None),
                    "version": getattr(args, "adapter_version", None),
                    "lora_module": _one_lora_module(args)},
        "server": {"host": getattr(args, "host", None), "port": getattr(args, "port", None),
                   "api_key": getattr(args, "api_key", None), "admin_key": getattr(args, "admin_key", None),
                   "max_queued_requests": getattr(args, "max_queued_requests", None),
                   "max_body_bytes": getattr(args, "max_body_bytes", None),
                   "read_timeout_s": getattr(args, "read_timeout", None),
                   "allowed_origins": getattr(args, "allowed_origins", None),
                   "reasoning_parser": getattr(args, "reasoning_parser", None),
                   "max_stored_responses": getattr(args, "max_stored_responses", None)},
    }
    return load_config(args.config, overrides)


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="alchemist", description="OpenAI-compatible LLM server that learns "
                                     "online from what it serves.")
    parser.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS)
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the OpenAI-compatible server")
    serve.add_argument("--log-level", dest="serve_log_level", type=str.upper, choices=LOG_LEVELS,
                       help="as before the command (uvicorn's request lines are INFO)")
    serve.add_argument("model_tag", nargs="?", metavar="MODEL",
                       help="local Hugging Face model directory, as `vllm serve MODEL` takes it (the same as --model)")
    serve.add_argument("--seed", dest="model_seed", type=int, metavar="SEED",
                       help="seeds sampling for requests without a seed of their own, as vLLM's --seed (default: "
                       "not seeded here; the adapter's first weights follow train.seed)")
    _add_config_flags(serve)
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/* (or ALCHEMIST_SERVER_API_KEY, "
                       "which keeps the key out of the process list)")
    serve.add_argument("--admin-key", help="key for the adapter routes /v1/adapters* (or ALCHEMIST_SERVER_ADMIN_KEY)")
    serve.add_argument("--max-queued-requests", type=int,
                       help="sequences (prompts x n) waiting beyond --max-num-seqs running; more get 429 "
                       "(default 256)")
    serve.add_argument("--max-body-bytes", type=int, help="larger request bodies get 413 (default 4 MiB)")
    serve.add_argument("--max-stored-responses", type=int, metavar="N",
                       help="stored responses of the Responses API (retrieve, previous_response_id), the oldest "
                       "pruned beyond N (default 10000; 0: none stored)")
    serve.add_argument("--read-timeout", type=float, metavar="SECONDS",
                       help="a request's headers must arrive within this long of the connection's opening, and its "
                       "body may pause no longer; else the connection closes (default 30)")
    serve.add_argument("--allowed-origins", type=origins, help="origins whose web pages may call the server from a "
                       "browser (CORS): comma-separated, or vLLM's JSON list; '*' is any (default: none)")
    serve.add_argument("--reasoning-parser", choices=list(REASONING_PARSERS),
                       help="a thinking model's <think> section as a chat message's `reasoning`, apart from its "
                       "`content` (as vLLM's flag; default: the answer's text as generated)")
    serve.add_argument("--adapter-dir", help="save the adapter here (PEFT format) and resume from it on start; "
                       "with training off, serve its newest version frozen")
    serve.add_argument("--adapter-version", type=int, help="with training off: the saved version to serve")
    serve.add_argument("--lora-modules", type=lora_module, nargs="+", metavar="NAME=DIR",
                       help="with training off: a PEFT adapter directory served frozen under NAME (or vLLM's JSON "
                       "form, {\"name\": …, \"path\": …}); one adapter")
    serve.add_argument("--adapter-save-every", type=int, help="save every N adapter versions (default 10)")
    serve.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                       help="replicas, one per device (cuda:0..N-1; on the CPU, N processes sharing the cores), "
                       "on one port, training one adapter (torch.distributed; the same as running under "
                       "torchrun --nproc-per-node N)")
    serve.add_argument("--max-restarts", type=int, default=10,
                       help="with --data-parallel-size: times the group is restarted after a replica dies (the "
                            "first group, failing before it serves, is not restarted)")

    add_feedback_commands(commands)

    from bench.cli import add_bench_commands

    add_bench_commands(commands, _add_config_flags)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.log_level = getattr(args, "serve_log_level", None) or args.log_level
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from engine.malloc_tuning import keep_freed_memory
    keep_freed_memory()
    if args.command == "feedback":
        return feedback_command(args)
    if args.command == "bench" and args.bench in ("colocate", "soak", "replicas", "backlog"):
        config = None  # the bench starts its own servers
    else:
        try:
            config = config_from_args(args)
            if args.command == "serve":
                refuse_a_key_left_unset(config)
        except (ValueError, FileNotFoundError) as exc:
            print(f"alchemist: configuration error: {exc}", file=sys.stderr)
            return 2
    if args.command == "serve":
        return serve_command(args, config, sys.argv[1:] if argv is None else argv)
    from bench.cli import run_bench_command

    return run_bench_command(args, config)


def serve_command(args: argparse.Namespace, config: AlchemistConfig, argv: list[str]) -> int:
    """`alchemist serve`: one server, the elastic agent of `--data-parallel-size` replicas,
    or one of those replicas (started by it or by torchrun)."""
    import dataclasses

    from engine.malloc_tuning import return_freed_memory
    from engine.model_loader import embedded_model_dir
    from server.replicas import die_with_parent, ensure_port_free, join_group, launch, replica_device, replica_from_env
    from trainer.replicated import Replica

    if args.data_parallel_size < 1 or args.max_restarts < 0:
        print("alchemist: configuration error: --data-parallel-size must be at least 1 and --max-restarts at "
              "least 0", file=sys.stderr)
        return 2
    replica = replica_from_env()
    if replica is not None:
        die_with_parent()  # before anything that waits: the model's conversion, the group's forming
    if (replica is not None or args.data_parallel_size > 1) and not config.model.model:
        try:  # converted outside any group: transformers writes only on rank 0
            embedded_model_dir()
        except FileNotFoundError as exc:  # the package that ships the model is missing
            print(f"alchemist: configuration error: {exc}", file=sys.stderr)
            return 2
        return_freed_memory()  # the conversion's heap, not kept by an agent that only supervises
    if replica is None and args.data_parallel_size > 1:
        missing = [f"--{flag} {path!r}" for flag, path in (("model", config.model.model),
                                                             ("tokenizer", config.model.tokenizer))
                   if path and not os.path.isdir(path)]
        try:  # said once, before any replica starts
            if missing:
                raise OSError(f"{', '.join(missing)} is no local directory")
            replica_device(config.model.device, Replica(0, args.data_parallel_size, 0, args.data_parallel_size))
            check_paths(config)
            ensure_port_free(config.server.host, config.server.port)
        except ValueError as exc:
            print(f"alchemist: configuration error: {exc}", file=sys.stderr)
            return 2
        except OSError as exc:
            print(f"alchemist: start-up error: {exc}", file=sys.stderr)
            return 2
        return launch(argv, args.data_parallel_size, args.max_restarts)
    from server.serve import build_server, run, run_replica
    try:  # a ValueError: what only the built server can judge (a saved adapter that does not fit)
        if replica is not None:
            device = replica_device(config.model.device, replica)
            config = dataclasses.replace(config, model=dataclasses.replace(config.model, device=device))
            join_group(replica, device)
            run_replica(config, replica)
            return 0
        check_paths(config)  # before the model loads and the directory is written
        ensure_port_free(config.server.host, config.server.port)
        app = build_server(config)
    except ValueError as exc:
        print(f"alchemist: configuration error: {exc}", file=sys.stderr)
        return 2
    except (OSError, RuntimeError) as exc:  # a model, tokenizer or directory that cannot be read or written
        logger.debug("start-up failed", exc_info=True)
        print(f"alchemist: start-up error: {exc} (--log-level debug for the traceback)", file=sys.stderr)
        return 2
    run(app, config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
