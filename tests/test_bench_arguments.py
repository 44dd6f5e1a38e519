"""The benchmarks' flags refuse a value no run can use with a usage error, before anything
loads (an outside pass: 52 bad values ended in tracebacks minutes in, reports of nothing
with exit 0, or — a negative Poisson rate — a trace that never ended)."""

import pytest

from server.cli import build_parser

BAD = [
    "bench colocate --rate -1", "bench colocate --rate 0", "bench colocate --rate nan", "bench colocate --seconds 0",
    "bench colocate --rounds 0", "bench colocate --feedback-fraction 2", "bench colocate --sweep 0.5,abc",
    "bench colocate --warmup-seconds -1", "bench soak --rate -1", "bench soak --seconds 0", "bench steps --steps 0",
    "bench serving --num-prompts 0", "bench serving --repeats 0", "bench serving --n -2", "bench http --streams 0",
    "bench http --streams 1,abc", "bench http --rounds 0", "bench structured --repeats 0",
    "bench training --mode dpo --tokens -5", "bench training --mode dpo --repeats 0",
    "bench training --mode grpo --response-tokens 0", "bench training --mode grpo --group-size 1",
    "bench training --mode cpt --sweep abc", "bench staleness --learning-rates -1",
    "bench staleness --entries-per-step 0", "bench staleness --bursts 0", "bench backlog --scenarios foo",
    "bench backlog --condition foo", "bench recording --tokens 0", "bench offload --budget-fraction -0.5",
    "bench offload --repeats 0", "bench replicas --replicas 1", "bench replicas --clients 0",
    "profile --out /tmp/p.json --tokens 0", "profile --out /nonexistent-dir/p.json",
    "bench training --mode dpo --json /nonexistent-dir/x.json",
    "bench colocate --train-config /nonexistent-dir/train.toml",  # (it failed after the first condition's run)
]


@pytest.mark.parametrize("command", BAD)
def test_a_value_no_run_can_use_is_a_usage_error(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(command.split())
    assert exit_.value.code == 2
    assert "error: argument" in capsys.readouterr().err


@pytest.mark.parametrize("command", [
    "bench colocate --warmup-seconds 0 --feedback-fraction 0 --sweep 0.25,0.5", "bench soak --seconds 150 --rate 0.5",
    "bench training --mode dpo --tokens 512", "bench training --mode grpo --group-size 8 --prompt-tokens 128 "
    "--response-tokens 32", "bench staleness --max-staleness 0,1", "bench backlog --scenarios cpt --warm-up 0",
    "bench offload --budget-fraction 0", "profile --out /tmp/p.json",
])
def test_the_documented_runs_still_parse(command):
    build_parser().parse_args(command.split())
