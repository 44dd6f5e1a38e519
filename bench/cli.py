"""The `alchemist bench …` and `alchemist profile` commands: their flags and dispatch.

Each command imports its benchmark module only when it runs (server start-up never
imports bench/)."""

from __future__ import annotations

import argparse
import dataclasses

from bench.arguments import (at_least, existing_file, fraction, listed, named_file, one_of, output_path,
                             positive)


def add_bench_commands(commands, add_config_flags) -> None:
    """Adds `bench {serving,prefix-cache,steps,http,structured,training,staleness,backlog,recording,colocate,
    offload,soak,replicas}` and `profile` to the CLI; `add_config_flags` adds the server's config flags to a parser."""
    bench = commands.add_parser("bench", help="benchmarks, each a side-by-side ratio in one run")
    benches = bench.add_subparsers(dest="bench", required=True)
    _add_serving_benches(benches, add_config_flags)
    _add_training_benches(benches, add_config_flags)
    replicas = benches.add_parser("replicas", help="N data-parallel replicas vs one, closed-loop with feedback")
    replicas.add_argument("--replicas", type=at_least(2), default=2)
    replicas.add_argument("--requests", type=at_least(1), default=48, help="labelled answers per condition")
    replicas.add_argument("--clients", type=at_least(1), default=8, help="closed-loop clients")
    replicas.add_argument("--max-tokens", type=at_least(1), default=24)
    replicas.add_argument("--rounds", type=at_least(1), default=2, help="conditions alternate, in rounds")
    replicas.add_argument("--learning-rate", type=positive, default=1e-4)
    replicas.add_argument("--no-training", action="store_true", help="serving alone (training off, no feedback)")
    replicas.add_argument("--json", type=output_path, help="write the results to this JSON file")
    colocate = benches.add_parser("colocate", help="serving latency with training off and on, over HTTP")
    colocate.add_argument("--policy", choices=["idle", "slo"], default="idle")
    colocate.add_argument("--rate", type=positive, default=0.5, help="requests per second (Poisson)")
    colocate.add_argument("--seconds", type=positive, default=60.0, help="trace length per run")
    colocate.add_argument("--tpot-slo-ms", type=positive, default=100.0)
    colocate.add_argument("--rounds", type=at_least(1), default=2, help="off/on pairs, alternating")
    colocate.add_argument("--seed", type=int, default=0)
    colocate.add_argument("--warmup-seconds", type=at_least(0, float), default=15.0,
                          help="a trace of other requests first on each server, reported apart as cold (0: none)")
    colocate.add_argument("--train-config", type=existing_file,
                          help="TOML passed to the training-on server (e.g. record_fraction)")
    colocate.add_argument("--no-feedback", action="store_true",
                          help="record but send no feedback (isolates the cost of recording)")
    colocate.add_argument("--feedback-fraction", type=fraction, default=1.0,
                          help="share of answers the client sends feedback for (the soak's mix: 0.33)")
    colocate.add_argument("--compare", choices=["training", "ledger", "gate", "ride", "trim"],
                          default="training",
                          help="training: off vs on; ledger: training on with an adapter directory, without vs "
                          "with the feedback ledger; gate: training on, without vs with the eval gate (--eval-set); "
                          "ride: training on, a recorded prefill's step alone vs running decodes riding along in it; "
                          "trim: training on, every pause in recording giving freed memory back vs only beyond "
                          "train.trim_slack_mib")
    colocate.add_argument("--eval-set", default="examples/capital_probes.jsonl", help="the probes of --compare gate")
    colocate.add_argument("--json", type=output_path, help="write the results to this JSON file")
    colocate.add_argument("--sweep", type=listed(positive), help="comma-separated rates; draws TPOT vs rate as PNG")
    colocate.add_argument("--plot", type=output_path, help="PNG path for --sweep (default bench-colocate-POLICY.png)")
    offload = benches.add_parser("offload", help="training with recorded layers kept, offloaded, recomputed, hedged")
    add_config_flags(offload)
    offload.add_argument("--tokens", type=at_least(1), default=512, help="prompt tokens per entry (CPT)")
    offload.add_argument("--entries", type=at_least(1), default=3, help="entries cached together")
    offload.add_argument("--repeats", type=at_least(1), default=2)
    offload.add_argument("--budget-fraction", type=fraction, default=0.5,
                         help="device budget as a fraction of the entries' recorded activations")
    offload.add_argument("--json", type=output_path, help="write the report to this JSON file")
    offload.add_argument("--sweep", action="store_true", help="also sweep the freed fraction of layers and plot it")
    offload.add_argument("--plot", type=output_path, help="PNG path for --sweep (default bench-offload.png)")
    profile = commands.add_parser("profile", help="measure this device and write the offloading and hedging maps")
    add_config_flags(profile)
    profile.add_argument("--out", type=output_path, required=True,
                         help="JSON file to write (load it with --offload-profile)")
    profile.add_argument("--tokens", type=listed(at_least(2)), default="128,512,1024",
                         help="token lengths to measure, comma-separated")
    soak = benches.add_parser("soak", help="mixed traffic with feedback for a while: errors, RSS growth, cache drain")
    soak.add_argument("--seconds", type=positive, default=600.0, help="traffic duration")
    soak.add_argument("--rate", type=positive, default=0.5, help="requests per second (Poisson)")
    soak.add_argument("--seed", type=int, default=0)
    soak.add_argument("--json", type=output_path, help="write the report (with the timeline) to this JSON file")
    soak.add_argument("--plot", type=output_path,
                      help="PNG of RSS and activation cache over time (default bench-soak.png)")


def _add_serving_benches(benches, add_config_flags) -> None:
    """`bench serving`, `bench structured` and `bench steps`."""
    serving = benches.add_parser("serving", help="engine vs Hugging Face generate and generate_batch")
    add_config_flags(serving)
    serving.add_argument("--num-prompts", type=at_least(1), default=8)
    serving.add_argument("--max-tokens", type=at_least(1), default=64)
    serving.add_argument("--repeats", type=at_least(1), default=3,
                         help="interleaved rounds: the first reported as cold, the others' median as warm")
    serving.add_argument("--same-prompts", action="store_true",
                         help="every round on the same prompts (by default each round's are new, of a new length)")
    serving.add_argument("--json", type=output_path, help="write the results to this JSON file")
    serving.add_argument("--with-adapter", action="store_true",
                         help="also serve with a LoRA adapter attached (what training mode costs serving)")
    serving.add_argument("--profile", type=output_path,
                         help="after the rounds, profile one engine run and write the table here")
    serving.add_argument("--n", type=at_least(1), help="instead: one request with n choices on a long prompt, forked "
                         "(one prefill) vs each choice prefilling, both vs n = 1")
    serving.add_argument("--prompt-tokens", type=at_least(1), default=1000, help="with --n: the prompt's length")
    serving.add_argument("--paths", default="engine,engine_sequential,engine_plain_linear,hf_generate,"
                         "hf_generate_batch", help="comma-separated paths to run (engine always runs)")
    prefix = benches.add_parser("prefix-cache", help="requests sharing a long beginning, with the prefix cache and "
                                "without it: time to first token, tokens computed")
    add_config_flags(prefix)
    prefix.add_argument("--prefix-tokens", type=at_least(1), default=1000, help="the shared beginning's length")
    prefix.add_argument("--suffix-tokens", type=at_least(1), default=32, help="each request's own question's length")
    prefix.add_argument("--num-requests", type=at_least(2), default=8, help="requests per round, one after another")
    prefix.add_argument("--max-tokens", type=at_least(1), default=16)
    prefix.add_argument("--repeats", type=at_least(1), default=3, help="interleaved rounds, each on a new beginning")
    prefix.add_argument("--json", type=output_path, help="write the results to this JSON file")
    structured = benches.add_parser("structured", help="grammar-constrained decoding vs unconstrained, per token")
    add_config_flags(structured)
    structured.add_argument("--num-prompts", type=at_least(1), default=8)
    structured.add_argument("--max-tokens", type=at_least(1), default=64)
    structured.add_argument("--repeats", type=at_least(1), default=3, help="interleaved rounds; medians are reported")
    structured.add_argument("--json", type=output_path, help="write the results to this JSON file")
    steps = benches.add_parser("steps", help="what a serving step would cost a GPU, counted: host syncs per decode "
                               "step and attention shapes over a trace with arrivals")
    add_config_flags(steps)
    steps.add_argument("--steps", type=at_least(1), default=400,
                       help="engine steps over which requests arrive (the trace runs on until they finish)")
    steps.add_argument("--seed", type=int, default=0)
    steps.add_argument("--json", type=output_path, help="write the results to this JSON file")
    http = benches.add_parser("http", help="streaming over HTTP vs the engine alone, closed batches: TPOT and the "
                              "event loop's CPU per token")
    add_config_flags(http)
    http.add_argument("--streams", type=listed(at_least(1)), default="1,8,32", help="comma-separated concurrencies")
    http.add_argument("--max-tokens", type=at_least(1), default=64)
    http.add_argument("--rounds", type=at_least(1), default=3,
                      help="engine and HTTP alternate, in rounds; the first is cold")
    http.add_argument("--async-output", default="auto", choices=("auto", "on", "off"),
                      help="the server's server.async_output: a step's tokens sent once the next step's device "
                           "work is queued (on), or as each step ends (off); auto: on on a GPU")
    http.add_argument("--json", type=output_path, help="write the results to this JSON file")


def _add_training_benches(benches, add_config_flags) -> None:
    """`bench training`, `bench staleness`, `bench backlog` and `bench recording`."""
    training = benches.add_parser("training", help="reuse path vs recompute path on the embedded model")
    add_config_flags(training)
    training.add_argument("--mode", choices=["cpt", "dpo", "grpo"], required=True)
    training.add_argument("--tokens", type=at_least(2), default=512, help="trained tokens per entry")
    training.add_argument("--repeats", type=at_least(1), default=3)
    training.add_argument("--json", type=output_path, help="write the results to this JSON file")
    training.add_argument("--sweep", type=listed(at_least(2)), nargs="?", const="128,256,512,1024", default=None,
                          help="comma-separated token lengths (default 128,256,512,1024); draws PNG plots")
    training.add_argument("--plot-prefix", type=output_path, help="PNG path prefix (default bench-training-MODE)")
    training.add_argument("--max-fit", type=listed(at_least(2)), nargs="?",
                          const="2048,3072,4096,5120,6144,7168,8192,10240,12288,16384",
                          default=None, help="also find the longest trained length each path fits on the GPU, "
                          "trying these comma-separated lengths in order")
    training.add_argument("--profile", type=output_path,
                          help="profile one job of each path at the longest length; write the table here")
    training.add_argument("--given-responses", action="store_true", help="DPO: both responses given (the "
                          "served one is not decoded first)")
    training.add_argument("--group-size", type=at_least(2), default=8, help="grpo: samples per prompt (G)")
    training.add_argument("--prompt-tokens", type=at_least(1), default=1024,
                          help="grpo: the shared prompt's length (P)")
    training.add_argument("--response-tokens", type=at_least(1), default=64, help="grpo: each sample's length (R)")
    training.add_argument("--sweep-group", type=listed(at_least(2)),
                          help="grpo: comma-separated group sizes to sweep (plots)")
    training.add_argument("--sweep-prompt", type=listed(at_least(1)),
                          help="grpo: comma-separated prompt lengths to sweep (plots)")
    training.add_argument("--one-vs-two-sweeps", action="store_true", help="dpo, grpo: the reuse job's "
                          "backward in one top-down sweep against two (suffixes, then prompt), side by side")
    training.add_argument("--stale", action="store_true", help="entries one adapter version old: reuse with "
                          "the served version's weights stashed, against recompute")
    staleness = benches.add_parser("staleness", help="learning with delayed (stashed) gradients vs strict "
                                   "recomputation, per learning rate")
    add_config_flags(staleness)
    staleness.add_argument("--learning-rates", type=listed(positive), default="1e-4,1e-3,3e-3")
    staleness.add_argument("--max-staleness", type=listed(at_least(0)), default="1,2",
                           help="values to compare with 0 (strict)")
    staleness.add_argument("--bursts", type=at_least(1), default=4)
    staleness.add_argument("--burst", type=at_least(1), default=3, help="requests per burst (stale by 0 .. burst-1)")
    staleness.add_argument("--entries-per-step", type=listed(at_least(1)), default="1",
                           help="comma-separated maxima of entries per optimizer step to compare (entries of one "
                           "version share a step)")
    staleness.add_argument("--json", type=output_path, help="write the results to this JSON file")
    backlog = benches.add_parser("backlog", help="labels faster than idle gaps: entries trained on their "
                                 "recordings and held-out learning, against strict recomputation, over HTTP")
    backlog.add_argument("--scenarios", type=listed(one_of("dpo", "cpt")), default="dpo,cpt",
                         help="comma-separated: dpo (24 labelled answers), cpt (a made-up fact served 12 times)")
    backlog.add_argument("--condition", type=named_file, action="append", default=[], metavar="NAME=TOML",
                         help="a server config to compare besides strict, steps_of_4 and default (repeatable)")
    backlog.add_argument("--learning-rate", type=positive, default=1e-4)
    backlog.add_argument("--warm-up", type=at_least(0), default=0, help="labelled answers trained one at a time first")
    backlog.add_argument("--json", type=output_path, help="write the results to this JSON file")
    recording = benches.add_parser("recording", help="recorded over plain prefill of a short prompt, by what happens "
                                   "to earlier recordings (kept, freed, trained) and beside decodes")
    add_config_flags(recording)
    recording.add_argument("--tokens", type=at_least(1), default=100)
    recording.add_argument("--repeats", type=at_least(1), default=6)
    recording.add_argument("--cases", help="comma-separated cases to run (default: every one)")
    recording.add_argument("--json", type=output_path, help="write the results to this JSON file")


# benchmarks that start servers (they serve as a user's would: the prefix cache on), the
# trace of a server's steps, and the one that measures the cache; the others compare paths in
# one process, the cache off: a round would otherwise find the prompts of the round before, or a
# path those of the path before
_PREFIX_CACHE_AS_CONFIGURED = frozenset({"colocate", "replicas", "soak", "backlog", "steps", "prefix-cache"})


def run_bench_command(args: argparse.Namespace, config) -> int:
    """Runs the parsed `bench …` or `profile` command; its exit status."""
    if getattr(args, "bench", None) not in _PREFIX_CACHE_AS_CONFIGURED:
        config = dataclasses.replace(config, cache=dataclasses.replace(config.cache, enable_prefix_caching=False))
    if args.command == "profile":
        from bench.profile import run_profile
        run_profile(config, args.out, tuple(int(n) for n in args.tokens.split(",")))
        return 0
    if args.bench == "serving" and args.n:
        from bench.serving_groups import run_group_serving_bench
        run_group_serving_bench(config, args.n, args.prompt_tokens, args.max_tokens, args.repeats, args.json)
        return 0
    if args.bench == "prefix-cache":
        from bench.prefix_cache import run_prefix_cache_bench
        run_prefix_cache_bench(config, args.prefix_tokens, args.suffix_tokens, args.num_requests, args.max_tokens,
                               args.repeats, args.json)
        return 0
    if args.bench == "serving":
        from bench.serving import PATHS as SERVING_PATHS, run_serving_bench
        unknown = set(args.paths.split(",")) - set(SERVING_PATHS)
        if unknown:
            raise SystemExit(f"--paths: unknown {sorted(unknown)}; choose from {', '.join(SERVING_PATHS)}")
        run_serving_bench(config, num_prompts=args.num_prompts, max_tokens=args.max_tokens,
                          repeats=args.repeats, json_path=args.json, with_adapter=args.with_adapter,
                          paths=tuple(args.paths.split(",")), profile_path=args.profile,
                          same_prompts=args.same_prompts)
        return 0
    if args.bench == "steps":
        from bench.step_counts import run_steps_bench
        run_steps_bench(config, args.steps, args.seed, args.json)
        return 0
    if args.bench == "http":
        from bench.http import run_http_bench
        run_http_bench(config, [int(n) for n in args.streams.split(",")], args.max_tokens, args.rounds, args.json,
                       args.async_output)
        return 0
    if args.bench == "structured":
        from bench.structured import run_structured_bench
        run_structured_bench(config, args.num_prompts, args.max_tokens, args.repeats, args.json)
        return 0
    if args.bench == "colocate":
        from bench.colocate import TrainingSide, run_colocate_bench
        sweep = [float(r) for r in args.sweep.split(",")] if args.sweep else None
        side = TrainingSide(args.policy, args.tpot_slo_ms, args.train_config, not args.no_feedback,
                            args.feedback_fraction, args.compare, args.eval_set)
        run_colocate_bench(side, args.rate, args.seconds, args.rounds, args.seed, args.json, sweep, args.plot,
                           args.warmup_seconds)
        return 0
    if args.bench == "replicas":
        from bench.replicas import run_replicas_bench
        run_replicas_bench(args.replicas, args.requests, args.clients, args.max_tokens, args.rounds,
                           args.learning_rate, args.json, not args.no_training)
        return 0
    if args.bench == "soak":
        from bench.soak import SoakConfig, run_soak_bench
        report = run_soak_bench(SoakConfig(seconds=args.seconds, rate=args.rate, seed=args.seed), args.json,
                                args.plot)
        return 0 if report["errors"] == 0 and report["cache_drained"] else 1
    if args.bench == "offload":
        from bench.offload import run_offload_bench
        run_offload_bench(config, args.tokens, args.entries, args.repeats, args.budget_fraction, args.json,
                          args.sweep, plot_path=args.plot)
        return 0
    if args.bench in ("backlog", "recording", "staleness", "training"):
        return _run_training_bench_command(args, config)
    return 1


def _run_training_bench_command(args: argparse.Namespace, config) -> int:
    """`bench backlog`, `recording`, `staleness` and `training`."""
    if args.bench == "backlog":
        from bench.backlog import run_backlog_bench
        conditions = dict(c.split("=", 1) for c in args.condition)
        run_backlog_bench(args.scenarios.split(","), conditions, args.learning_rate, json_path=args.json,
                          warm_up=args.warm_up)
        return 0
    if args.bench == "recording":
        from bench.recording import run_recording_bench
        run_recording_bench(config, args.tokens, args.repeats, args.json,
                            args.cases.split(",") if args.cases else None)
        return 0
    if args.bench == "staleness":
        from bench.staleness import run_staleness_bench
        run_staleness_bench(config, [float(x) for x in args.learning_rates.split(",")],
                            [int(x) for x in args.max_staleness.split(",")], args.bursts, args.burst, args.json,
                            tuple(int(x) for x in args.entries_per_step.split(",")))
        return 0
    if args.bench == "training" and args.one_vs_two_sweeps:
        from bench.training_sweeps import run_sweeps_bench
        tokens = args.prompt_tokens if args.mode == "grpo" else args.tokens
        run_sweeps_bench(config, args.mode, tokens, args.repeats, args.group_size, args.response_tokens, args.json)
        return 0
    if args.bench == "training" and args.mode == "grpo":
        from bench.training_grpo import run_grpo_training_bench
        ints = lambda text: [int(n) for n in text.split(",")] if text else None  # noqa: E731
        run_grpo_training_bench(config, args.group_size, args.prompt_tokens, args.response_tokens, args.repeats,
                                args.json, ints(args.sweep_group), ints(args.sweep_prompt), args.plot_prefix)
        return 0
    if args.bench == "training":
        from bench.training import run_training_bench
        sweep = [int(n) for n in args.sweep.split(",")] if args.sweep else None
        max_fit = [int(n) for n in args.max_fit.split(",")] if args.max_fit else None
        run_training_bench(config, args.mode, args.tokens, args.repeats, args.json, sweep, args.plot_prefix,
                           args.stale, max_fit, args.given_responses, args.profile)
        return 0
    return 1
