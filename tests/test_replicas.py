"""Data-parallel replicas (server/replicas.py, trainer/replicated.py, server/fanout.py).

The rounds over gloo in two processes: every rank ends each step with the same weights,
bit for bit, and they are the weights one optimizer reaches on the summed gradients. Then
the real thing, as a user runs it: `alchemist serve --data-parallel-size 2` on a tiny
model, where a label posted to the other replica trains on the one that served it, a
rollback reaches both, and a replica killed with `kill -9` comes back at the version the
server had, its accepted labels trained; and with the eval gate, rank 0's verdict is
every replica's, each quarantining the labels it trained.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.launch import free_port, server_process
from server.fanout import merge_metrics
from server.replicas import replica_device
from server.response_store import RESPONSES_FILE, ResponseStore
from server.routes_admin import whole_server_status
from tests.servers import wait_for
from tests.tiny import tiny_model, tiny_tokenizer
from trainer.ledger_db import LEDGER_FILE, read_ledger
from trainer.optimizer import AdapterOptimizer
from trainer.replica_fates import FateWatermarks
from trainer.replica_messages import CombinedStep, ReplicatedRollback
from trainer.replicated import Replica, ReplicaSync, weights_digest

SHAPES = [(4, 8), (8, 4), (3,)]
STEPS = 3


def test_a_completion_id_names_the_replica_that_served_it():
    replica = Replica(rank=1, world_size=2)
    completion = replica.tag("chatcmpl-") + "0123abcd"
    assert completion.startswith("chatcmpl-r1-") and replica.owns(completion)
    assert Replica(0, 2).owner_of(completion) == 1
    assert Replica(0, 2).owner_of("chatcmpl-0123abcd") == 0  # served by a single server
    assert Replica(0, 1).owner_of(completion) == 0  # a smaller group takes it
    assert Replica(0, 2).owner_of("cmpl-r1-abc-0") == 1  # one of several prompts
    assert Replica(0, 2).owner_of(Replica(1, 2).tag("resp_") + "0123abcd") == 1  # OpenAI's response id


def test_each_replica_takes_its_own_device():
    replica = Replica(rank=3, world_size=4, local_rank=1, local_world_size=2)
    assert replica_device("cpu", replica) == "cpu"
    assert replica_device("cuda", replica) == "cuda:1"
    with pytest.raises(ValueError, match="cuda:LOCAL_RANK"):
        replica_device("cuda:0", replica)


def test_only_the_private_port_answers_for_one_replica():
    from starlette.requests import Request

    from server.fanout import LOCAL_HEADER, Peers

    peers = Peers(rank=1, addresses=["127.0.0.1:5001", "127.0.0.1:5002"])

    def request(port: int) -> Request:
        return Request({"type": "http", "headers": [(LOCAL_HEADER.encode(), b"1")], "server": ("127.0.0.1", port)})

    assert peers.is_local(request(5002))
    assert not peers.is_local(request(8000))  # a client sending the header on the public port


def test_metrics_of_every_replica_carry_an_engine_label():
    text = ("# HELP alchemist:request_success_total Finished.\n# TYPE alchemist:request_success_total counter\n"
            'alchemist:request_success_total{finished_reason="stop"} %d\n')
    merged = merge_metrics([text % 3, text % 4]).decode()
    assert 'alchemist:request_success_total{engine="0",finished_reason="stop"} 3.0' in merged
    assert 'alchemist:request_success_total{engine="1",finished_reason="stop"} 4.0' in merged
    assert merged.count("# TYPE alchemist:request_success_total counter") == 1


def _asked_of_a_hung_replica(ask):
    """`ask(peers, request)` run as rank 0 of two, rank 1 hung (SIGSTOP: the kernel still
    accepts its connections, and nothing answers); its result, and the seconds it took."""
    import asyncio
    import socket

    from starlette.requests import Request

    from server.fanout import Peers

    async def asked():
        peers = Peers(rank=0, addresses=["127.0.0.1:5001", f"127.0.0.1:{hung.getsockname()[1]}"])
        try:
            return await ask(peers, Request({"type": "http", "method": "GET", "headers": [], "path": "/",
                                             "query_string": b""}))
        finally:
            await peers.close()

    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen()
        started = time.monotonic()
        return asyncio.run(asked()), time.monotonic() - started


def test_a_replica_that_does_not_answer_a_scrape_in_time_is_left_out_and_said_down():
    """A hung replica held every replica's `/metrics` for a minute, past Prometheus's scrape
    timeout, so no sample was scraped at all (an outside pass). The others' samples come
    back in time, and `alchemist:replica_up` says which replica is missing."""
    answers, seconds = _asked_of_a_hung_replica(lambda peers, request: peers.ask_each(request, "/metrics", 0.5))
    assert answers == {1: None}
    assert seconds < 30  # far from the 60 s a scrape waited before (a loaded machine is slow)
    text = ("# HELP alchemist:request_success_total Finished.\n# TYPE alchemist:request_success_total counter\n"
            'alchemist:request_success_total{finished_reason="stop"} 3\n')
    merged = merge_metrics([text, None]).decode()
    assert 'alchemist:request_success_total{engine="0",finished_reason="stop"} 3.0' in merged
    assert 'engine="1",finished_reason' not in merged
    assert 'alchemist:replica_up{engine="0"} 1.0' in merged and 'alchemist:replica_up{engine="1"} 0.0' in merged


def test_a_status_read_does_not_wait_on_a_hung_replica_past_its_bound():
    """An outside pass: with one replica stopped, `GET /v1/adapters` on the other gave no
    answer in 40 s (a peer's question waits up to a minute); it is a 503 within its bound."""
    from server.errors import APIError

    async def status(peers, request):
        try:
            await peers.ask_all(request, "/v1/adapters", method="GET", timeout_s=0.5)
        except APIError as refused:
            return refused

    refused, seconds = _asked_of_a_hung_replica(status)
    assert seconds < 30 and isinstance(refused, APIError) and refused.status == 503
    assert refused.code == "replica_unavailable" and "replica 1 did not answer" in str(refused)


def test_the_whole_servers_adapter_status_sums_the_training_counters():
    def answer(rank, entries, loss):
        return {"version": 5, "saved": [], "replicas": [{"rank": rank, "version": 5, "digest": "ab",
                                                         "requests_served": rank + 1}],
                "training": {"trained_entries": entries, "last_loss": loss, "train_tokens": 10 * entries}}
    merged = whole_server_status([answer(0, 2, 0.5), answer(1, 3, 0.7)])
    assert merged["training"] == {"trained_entries": 5, "last_loss": 0.6, "train_tokens": 50}
    assert [r["rank"] for r in merged["replicas"]] == [0, 1]
    # the replicas' last losses, averaged over those that trained: rank 0 alone may not have
    assert whole_server_status([answer(0, 0, None), answer(1, 3, 0.7)])["training"]["last_loss"] == 0.7
    assert whole_server_status([answer(0, 0, None), answer(1, 0, None)])["training"]["last_loss"] is None


# -- the rounds over gloo -------------------------------------------------------------------


def adapter_params(seed: int) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in SHAPES]


def _gradients(rank: int, step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * rank + step)
    return [torch.randn(shape, generator=generator) for shape in SHAPES]


def _entries(rank: int, step: int) -> int:
    return 0 if (rank, step) == (1, 1) else rank + 1  # rank 1 has nothing to train at step 1


# who contributed to a round, by its entries (rank 0 brings one, rank 1 two)
CONTRIBUTORS = {1: (0,), 2: (1,), 3: (0, 1)}


def _rank_main(rank: int, world_size: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    steps_group = dist.new_group(backend="gloo")  # the test's barrier: never the sync thread's group
    params = adapter_params(seed=rank)  # initialised apart: the adoption makes them rank 0's
    optimizer = AdapterOptimizer(params, learning_rate=0.01, max_grad_norm=1.0)
    sync = ReplicaSync(params, rank, round_interval_s=0.01)

    def restore(snapshot):
        with torch.no_grad():
            for p, w in zip(params, snapshot):
                p.copy_(w)

    sync.adopt_rank0(lambda: [p.detach().clone() for p in params], restore)
    sync.start(0)
    digests, groups = [], []
    for step in range(STEPS):
        entries = _entries(rank, step)
        if entries:
            for p, g in zip(params, _gradients(rank, step)):
                p.grad = g
            sync.contribute(entries, finite=True)
        expected = sum(_entries(r, step) for r in range(world_size))
        deadline = time.time() + 30
        while expected:  # the two contributions land in one round or in two
            assert time.time() < deadline, "no round result"
            combined = sync.next_result()
            if combined is None:
                time.sleep(0.01)
                continue
            assert isinstance(combined, CombinedStep)
            assert combined.mine == (rank in CONTRIBUTORS[combined.entries])
            sync.load_gradients(combined)
            assert optimizer.step(combined.finite, combined.entries)
            digests.append(weights_digest(params))
            groups.append(combined.entries)
            expected -= combined.entries
        dist.barrier(group=steps_group)
    sync.close()
    torch.save({"digests": digests, "groups": groups, "weights": [p.detach().clone() for p in params]},
               f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def test_every_replica_applies_the_same_steps_as_one_optimizer_on_the_summed_gradients(tmp_path):
    mp.spawn(_rank_main, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert ranks[0]["groups"] == ranks[1]["groups"]  # the same rounds
    assert ranks[0]["digests"] == ranks[1]["digests"]  # the same weights after every step, bit for bit
    assert len(set(ranks[0]["digests"])) == len(ranks[0]["groups"]) >= STEPS
    plain = adapter_params(seed=0)
    optimizer = AdapterOptimizer(plain, learning_rate=0.01, max_grad_norm=1.0)
    groups = iter(ranks[0]["groups"])
    for step in range(STEPS):
        expected = sum(_entries(r, step) for r in range(2))
        while expected:
            entries = next(groups)
            for i, p in enumerate(plain):
                p.grad = sum(_gradients(r, step)[i] for r in CONTRIBUTORS[entries])
            optimizer.step(True, entries)
            expected -= entries
    for mine, theirs in zip(ranks[0]["weights"], plain):
        torch.testing.assert_close(mine, theirs.detach(), rtol=1e-6, atol=1e-7)


def _left_out_main(rank: int, world_size: int, port: int, out: str) -> None:
    """Rank 0 asks for a rollback; each replica sees it made before applying it. Rank 1's
    job ran before it applied it (it contributes at once); rank 0's after."""
    import types

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    test_group = dist.new_group(backend="gloo")  # the test's barrier: never the sync thread's group
    params = adapter_params(seed=0)
    sync = ReplicaSync(params, rank, round_interval_s=0.01)
    sync.start(0)
    if rank == 0:
        sync.request_rollback(types.SimpleNamespace(version=0))
    seen, deadline = [], time.time() + 30
    while not any(isinstance(item, ReplicatedRollback) for item in seen):
        assert time.time() < deadline, "no rollback"
        item = sync.next_result()
        seen.append(item) if item is not None else time.sleep(0.01)
    if rank == 0:
        sync.rollbacks_applied += 1  # (as OnlineTraining applies it) the job runs after it
    for p, g in zip(params, _gradients(rank, 0)):
        p.grad = g
    sync.contribute(rank + 1, finite=True)
    expected = {"CombinedStep", "LeftOut"} if rank == 1 else {"CombinedStep"}  # in one round or two
    while not expected <= {type(item).__name__ for item in seen}:
        assert time.time() < deadline, "no step"
        item = sync.next_result()
        seen.append(item) if item is not None else time.sleep(0.01)
    step = next(item for item in seen if isinstance(item, CombinedStep))
    torch.save({"kinds": sorted(type(item).__name__ for item in seen), "entries": step.entries, "mine": step.mine,
                "grads": step.grads.clone()}, f"{out}/left{rank}.pt")
    dist.barrier(group=test_group)
    sync.close()
    dist.destroy_process_group()


def test_a_job_run_on_weights_a_rollback_replaced_is_left_out_of_the_replicas_step(tmp_path):
    """A replica's job that computed while a rollback's round went by handed its gradients
    to the next round: they were summed into a step applied on the restored weights, and
    its labels read trained into a version that holds the rolled-back weights' gradient (a
    review of the replicas' protocol). Left out, as one server abandons such a job: the
    step sums the others', and that replica's entries train again."""
    mp.spawn(_left_out_main, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"left{rank}.pt") for rank in range(2)]
    assert ranks[1]["kinds"] == ["CombinedStep", "LeftOut", "ReplicatedRollback"], ranks[1]["kinds"]
    assert ranks[0]["kinds"] == ["CombinedStep", "ReplicatedRollback"], ranks[0]["kinds"]
    assert [r["entries"] for r in ranks] == [1, 1] and [r["mine"] for r in ranks] == [True, False]
    alone = torch.cat([g.reshape(-1) for g in _gradients(0, 0)])
    for r in ranks:
        torch.testing.assert_close(r["grads"], alone)


def _largest_main(rank: int, world_size: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    sync = ReplicaSync(adapter_params(seed=rank), rank, round_interval_s=0.01)
    Path(out, f"largest{rank}").write_text(str(sync.largest([17, 3][rank])))
    sync.close()
    dist.destroy_process_group()


def test_the_replicas_agree_on_the_largest_version_their_nodes_ledgers_know(tmp_path):
    """What each node's ledger knows (server/build.py, before rank 0 resumes)."""
    mp.spawn(_largest_main, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    assert [(tmp_path / f"largest{rank}").read_text() for rank in range(2)] == ["17", "17"]


# -- the server, as users run it ------------------------------------------------------------

QUESTION = {"model": "tiny", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]}


def _private_addresses(log_path: str, expected: int) -> dict[int, str]:
    """Every replica's private address, from the log (the first replica up answers /health
    before the others are)."""
    def found() -> list[tuple[str, str]]:
        return re.findall(r"replica (\d+) serving on port \d+ \(private ([\d.:]+)\)", Path(log_path).read_text())

    wait_for(lambda: len({rank for rank, _ in found()}) == expected)
    addresses = {int(rank): address for rank, address in found()[-expected:]}
    assert sorted(addresses) == list(range(expected)), found()
    return addresses


def _replica_pids(launcher: int) -> list[int]:
    children = Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()
    return [int(pid) for pid in children]


def _served_by_each(url: str, addresses: dict[int, str]) -> dict[int, list[str]]:
    """Two completions served by each replica (asked on its private port)."""
    ids: dict[int, list[str]] = {}
    for rank, address in addresses.items():
        with httpx.Client(base_url=f"http://{address}", timeout=120) as client:
            ids[rank] = [client.post("/v1/chat/completions", json=QUESTION).json()["id"] for _ in range(2)]
    return ids


def _status(url: str) -> dict:
    return httpx.get(f"{url}/v1/adapters", timeout=60).json()


def _trained(url: str) -> dict[str, float]:
    """Trained entries by replica (the `engine` label)."""
    counts: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=60).text.splitlines():
        if line.startswith("alchemist:trained_entries_total{"):
            engine = re.search(r'engine="(\d+)"', line).group(1)
            counts[engine] = counts.get(engine, 0.0) + float(line.split()[-1])
    return counts


def _flags(tmp_path: Path, training: bool = True) -> list[str]:
    """`alchemist serve` with two replicas on a tiny model saved to `tmp_path` (`training`:
    DPO, saving every version to an adapter directory there)."""
    model_dir = tmp_path / "model"
    tiny_model("llama").save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    trains = ["--train-mode", "dpo", "--adapter-dir", str(tmp_path / "adapters"), "--adapter-save-every", "1"]
    return ["--data-parallel-size", "2", "--model", str(model_dir), "--served-model-name", "tiny", "--device", "cpu",
            "--dtype", "float32", *(trains if training else []), "--max-model-len", "512"]


def _assert_listens_on_loopback_only(agent_pid: int) -> None:
    """Every port the agent and its replicas listen on is loopback's (the server's --host is):
    torch's c10d rendezvous store listened on every interface and unpickled what it held,
    and gloo on the host's address (an outside pass ran code as the server through it)."""
    import psutil

    agent = psutil.Process(agent_pid)
    listening = [(process.pid, c.laddr) for process in [agent, *agent.children(recursive=True)]
                 for c in process.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    assert len(listening) >= 6 and all(address.ip == "127.0.0.1" for _, address in listening), listening
    assert sum(pid == agent_pid for pid, _ in listening) == 1, listening  # its store, not a failed group's too


@pytest.mark.slow  # a group of two server processes, killed and restarted
def test_two_replicas_serve_one_adapter_on_one_port(tmp_path):
    adapter_dir = tmp_path / "adapters"
    with server_process(*_flags(tmp_path), env={"OMP_NUM_THREADS": "1"}) as (url, launcher):
        addresses = _private_addresses(launcher.log_path, 2)
        ids = _served_by_each(url, addresses)
        assert all(i.startswith(f"chatcmpl-r{rank}-") for rank, served in ids.items() for i in served)
        _assert_listens_on_loopback_only(launcher.pid)

        # the node's replicas store responses in one file beside the ledger: either continues the other's
        first = httpx.post(f"http://{addresses[0]}/v1/responses", timeout=120, json={
            "model": "tiny", "input": "Hi", "max_output_tokens": 2, "train": False}).json()
        second = httpx.post(f"http://{addresses[1]}/v1/responses", timeout=120, json={
            "model": "tiny", "input": "Then?", "max_output_tokens": 2, "previous_response_id": first["id"],
            "train": False})
        assert second.status_code == 200 and second.json()["previous_response_id"] == first["id"], second.text
        shared = ResponseStore(adapter_dir / RESPONSES_FILE)  # each replica wrote the one it served there
        assert shared.get(first["id"]) is not None and shared.get(second.json()["id"]) is not None
        shared.close()

        # a label posted to the replica that did not serve its completion trains where it was served
        for rank, served in ids.items():
            other = addresses[1 - rank]
            r = httpx.post(f"http://{other}/v1/feedback", json={"id": served[0], "chosen": "Paris."}, timeout=60)
            assert r.status_code == 200, r.text
        wait_for(lambda: _trained(url) == {"0": 1.0, "1": 1.0})
        status = _status(url)
        cards = status["replicas"]
        assert [c["rank"] for c in cards] == [0, 1] and cards[0]["digest"] == cards[1]["digest"]
        assert cards[0]["version"] == cards[1]["version"] == status["version"] >= 1
        assert status["training"]["trained_entries"] == 2
        saved_state = adapter_dir / f"v{status['version']:08d}" / "alchemist_state.json"
        wait_for(saved_state.is_file)  # rank 0 saved the version: the entries in it, both replicas'
        assert json.loads(saved_state.read_text())["entries_in_weights"] == 2
        fates = {row.request.id: row.fate for row in read_ledger(adapter_dir / LEDGER_FILE)}
        assert fates[ids[0][0]] == fates[ids[1][0]] == "trained"

        # a rollback asked of replica 1 is applied by both
        r = httpx.post(f"http://{addresses[1]}/v1/adapters/rollback", json={"version": 0}, timeout=180)
        assert r.status_code == 200, r.text
        answered = r.json()  # the whole server's, as GET answers: every replica's card, the counters summed
        assert [c["rank"] for c in answered["replicas"]] == [0, 1] and answered["version"] == status["version"] + 1
        assert answered["training"]["trained_entries"] == 2
        rolled = _status(url)
        assert rolled["version"] == status["version"] + 1 and rolled["rollbacks"]["manual"] == 1
        assert {c["digest"] for c in rolled["replicas"]} == {rolled["replicas"][0]["digest"]} != {cards[0]["digest"]}

        # labels accepted, then a replica killed: the group comes back at the version it had, and trains them
        for rank, served in ids.items():
            r = httpx.post(f"http://{addresses[rank]}/v1/feedback", json={"id": served[1], "chosen": "Paris."},
                           timeout=60)
            assert r.status_code == 200, r.text
        wait_for(lambda: sum(_trained(url).values()) == 4.0)
        unlabelled = _served_by_each(url, addresses)  # they take their labels after the restart
        before = _status(url)
        os.kill(_replica_pids(launcher.pid)[1], signal.SIGKILL)

        def back() -> bool:
            try:
                return httpx.get(f"{url}/v1/adapters", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        time.sleep(2)
        wait_for(back, poll_s=0.5)  # the time it takes is a figure (BENCHMARKS.md), not a bound here
        after = _status(url)
        assert after["version"] == before["version"] and after["restored_from"] == before["version"]
        _assert_listens_on_loopback_only(launcher.pid)  # the restarted group's store and collectives too
        assert {c["digest"] for c in after["replicas"]} == {before["replicas"][0]["digest"]}
        # each replica took back its own requests from the node's ledger: their labels train where they land
        for served in unlabelled.values():
            r = httpx.post(f"{url}/v1/feedback", json={"id": served[0], "chosen": "Paris."}, timeout=60)
            assert r.status_code == 200, r.text
        wait_for(lambda: _trained(url) == {"0": 1.0, "1": 1.0})

        # Ctrl-C: the agent passes SIGINT on, and each replica shuts down, without the traceback of the
        # signal uvicorn raises again once done (an outside pass found one from each replica)
        said_before = Path(launcher.log_path).stat().st_size
        launcher.send_signal(signal.SIGINT)
        assert launcher.wait(60) == 0
    with open(launcher.log_path) as log:
        log.seek(said_before)
        said = log.read()
    assert "the replicas stopped on signal SIGINT" in said and "Traceback" not in said


@pytest.mark.slow  # a group of two server processes, once
def test_a_group_that_fails_to_start_is_not_started_again(tmp_path):
    """An adapter directory another process trains into fails every start the same way: the
    group exits 2 with that error, said once, instead of loading the model 11 times (the
    elastic agent restarts whatever failed; `launch` restarts only a group that served)."""
    import fcntl
    import subprocess
    import sys

    flags = _flags(tmp_path)
    adapters = tmp_path / "adapters"
    adapters.mkdir()
    with open(adapters / ".lock", "a+") as held:  # as a server training into it holds it
        fcntl.lockf(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        root = Path(__file__).resolve().parents[1]
        run = subprocess.run([sys.executable, "-m", "server.cli", "serve", *flags, "--port", str(free_port())],
                             cwd=root, capture_output=True, text=True, timeout=300,
                             env={**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"})
    assert run.returncode == 2, run.stderr[-2000:]
    assert run.stderr.count("another process is training into the adapter directory") == 1, run.stderr[-2000:]
    assert "failed to start" in run.stderr and "not restarted" in run.stderr


@pytest.mark.slow  # a group of two server processes
def test_rank_0s_gate_verdict_is_every_replicas(tmp_path):
    """Any move away from the base model fails this gate (a KL bound of 1e-9): every
    version is rejected, on both replicas at once, each quarantining its own label."""
    flags = [*_flags(tmp_path), "--eval-set", "examples/capital_probes.jsonl", "--eval-max-kl", "1e-9"]
    with server_process(*flags, env={"OMP_NUM_THREADS": "1"}) as (url, launcher):
        addresses = _private_addresses(launcher.log_path, 2)
        start = _status(url)
        for rank in (0, 1):  # rank 0 first: its KL sample then holds a trained prompt
            with httpx.Client(base_url=f"http://{addresses[rank]}", timeout=120) as client:
                completion = client.post("/v1/chat/completions", json=QUESTION).json()["id"]
            r = httpx.post(f"{url}/v1/feedback", json={"id": completion, "chosen": "Paris."}, timeout=60)
            assert r.status_code == 200, r.text
            wait_for(lambda: (_status(url)["gate"] or {}).get("rejected") == rank + 1)
            status = _status(url)
            assert status["gate"]["quarantined_labels"] == rank + 1
            assert {c["version"] for c in status["replicas"]} == {status["version"]}
            assert {c["digest"] for c in status["replicas"]} == {start["replicas"][0]["digest"]}  # promoted weights
            wait_for(lambda: {row.request.id: row.fate for row in read_ledger(
                tmp_path / "adapters" / LEDGER_FILE)}.get(completion) == "quarantined")


@pytest.mark.slow  # two replica processes, as torchrun starts them
def test_under_torchrun_the_first_replica_of_a_node_refuses_a_port_another_group_shares(tmp_path):
    """Without `alchemist serve -dp` (no agent of ours to check), local rank 0 checks the
    port before any replica of its group binds it."""
    import socket
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    port, master = free_port(), free_port()
    flags = [f for f in _flags(tmp_path) if f not in ("--data-parallel-size", "2")]
    with socket.socket() as other_group:
        other_group.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        other_group.bind(("127.0.0.1", port))
        other_group.listen()
        replicas = [subprocess.Popen(
            [sys.executable, "-m", "server.cli", "serve", *flags, "--host", "127.0.0.1", "--port", str(port)],
            cwd=root, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", "RANK": str(rank),
                 "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(master)}) for rank in (0, 1)]
        try:
            outcomes = [(replica.wait(120), replica.stderr.read()) for replica in replicas]
        finally:
            for replica in replicas:
                replica.kill()
    assert outcomes[0][0] == 2 and f"port {port} on 127.0.0.1 is in use" in outcomes[0][1], outcomes[0][1][-2000:]
    assert outcomes[1][0] != 0


def _hung_peer_main(rank: int, world_size: int, port: int, out: str) -> None:
    """Rank 1 joins, then hangs (its sync thread never starts, as a stopped process's);
    rank 0's round times out, and it leaves the group: SIGTERM to itself, `left` set."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    signals = []
    signal.signal(signal.SIGTERM, lambda *_: signals.append("SIGTERM"))  # as uvicorn's handler would
    sync = ReplicaSync(adapter_params(seed=rank), rank, round_interval_s=0.01, round_timeout_s=5)
    sync.adopt_rank0(lambda: [p.detach().clone() for p in sync.params], lambda snapshot: None)
    done = Path(out) / "rank0.json"
    if rank == 1:
        wait_for(done.is_file, timeout=180)
        os._exit(0)
    sync.start(0)
    wait_for(lambda: signals, timeout=120)  # the handler runs on this, the main, thread
    done.write_text(json.dumps({"stopped": sync.stopped, "signals": signals}))
    os._exit(0)


def test_a_replica_whose_round_times_out_leaves_the_group_to_restart_it(tmp_path):
    """A replica that hangs (SIGSTOP, a stuck device) used to leave the others serving on,
    never training again, their labels accepted and held: a round that fails now makes the
    replica leave: SIGTERM to itself, which its process ends by (uvicorn raises it again after
    shutting down), and on which the elastic agent restarts the group."""
    mp.start_processes(_hung_peer_main, args=(2, free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    result = json.loads((tmp_path / "rank0.json").read_text())
    assert "a collective failed" in result["stopped"] and result["signals"] == ["SIGTERM"]


def rounds_with(params, results) -> ReplicaSync:
    """This replica's side of the rounds, the others' results already queued: the sync
    thread (and its collectives) is not started."""
    import collections
    import threading

    sync = ReplicaSync.__new__(ReplicaSync)
    sync.params, sync.rank, sync.stopped = params, 1, None
    sync._results, sync._lock, sync._stop = collections.deque(results), threading.Lock(), threading.Event()
    sync._thread, sync._stream = threading.Thread(target=lambda: None), None
    sync.fates = FateWatermarks(0)
    return sync


def test_at_shutdown_a_replica_mid_job_still_applies_the_steps_the_others_apply():
    """SIGTERM while labels train: a replica whose job was still computing skipped the last
    rounds' steps that the others applied, so rank 0 (which saves) could stop a version
    behind them, and their ledger fates named a version no replica saved. The job gives
    way (its labels stay in the ledger, untrained) and the step applies."""
    from tests.conftest import run_into_a_backward
    from tests.test_training import label, make_trainer, serve
    from trainer.entries import EntryState

    training = make_trainer(mode="dpo")
    serve(training, "mine")
    label(training, "mine")
    run_into_a_backward(training)
    params = training.optimizer.params
    others = CombinedStep(torch.cat([torch.ones(p.numel()) for p in params]), entries=1, finite=True, mine=False)
    training.replicas = training.trainer.replicas = rounds_with(params, [others])
    training.close()
    assert training.optimizer.version == 1 and not training.replicas.has_result()
    assert training.cache.get("mine").state is EntryState.READY  # not trained: a restart trains its label


def test_a_replicas_job_left_out_after_a_rollback_trains_again_on_the_restored_weights():
    """The device thread's side of `LeftOut`: the job that handed its gradients to a round
    after the rollback's is dropped, and its entry trains again, recomputed under the
    weights the rollback restored (it had trained into the version after the rollback,
    on the replaced weights' gradient)."""
    import queue

    from tests.conftest import run_into_a_backward
    from tests.test_training import label, make_trainer, serve
    from trainer.entries import EntryState
    from trainer.replica_messages import LeftOut

    training = make_trainer(mode="dpo")
    before = training.lifecycle.snapshot()  # version 0: what the operator rolls back to
    with torch.no_grad():
        for p in training.optimizer.params:
            p.add_(0.01)
    training.optimizer.version = 1
    serve(training, "chatcmpl-r1-x")
    label(training, "chatcmpl-r1-x")
    sync = rounds_with(training.optimizer.params, [])
    sync._inbox, sync.rollbacks_applied = queue.Queue(), 0
    training.replicas = training.trainer.replicas = sync
    run_into_a_backward(training)  # the job computes under version 1's weights
    sync._results.append(ReplicatedRollback(before))
    assert not training.sync_due()  # (no result applies under a computing job)
    while training.trainer.computing():
        training.run_slice()
    assert sync._inbox.get_nowait().rollbacks == 0  # handed over before the rollback was applied
    training.apply_synced()
    assert training.optimizer.version == 2 and sync.rollbacks_applied == 1
    sync._results.append(LeftOut(1))  # what the next round makes of it
    training.apply_synced()
    entry = training.cache.get("chatcmpl-r1-x")
    assert entry is not None and entry.state is EntryState.READY and not training.trainer.in_job()
    for _ in range(1000):  # trains again, under version 2 (version 0's weights)
        if not sync._inbox.empty() or not training.run_slice():
            break
    assert sync._inbox.get_nowait().rollbacks == 1
    training.close()


def test_a_replica_that_could_not_apply_a_result_applies_no_later_one_nor_saves(monkeypatch):
    """A review: a replica that failed to apply step I "left the group" but went on applying
    step J while its shutdown ran, and rank 0 then saved k + J as the version the others
    hold as k + I. It applies nothing more, and saves nothing at shutdown: the group
    restarts from the last version saved."""
    from tests.test_training import make_trainer

    training = make_trainer(mode="dpo")
    params = training.optimizer.params
    steps = [CombinedStep(torch.randn(sum(p.numel() for p in params)), entries=1, finite=True, mine=False)
             for _ in range(2)]
    training.replicas = training.trainer.replicas = rounds_with(params, steps)
    left, saves = [], []
    monkeypatch.setattr(os, "kill", lambda pid, sig: left.append(sig))  # what leave() sends
    monkeypatch.setattr(training.lifecycle, "save_final", lambda **kwargs: saves.append(kwargs))
    clip = torch.nn.utils.clip_grad_norm_
    failures = [RuntimeError("CUDA out of memory")]

    def clip_once_failing(*args, **kwargs):
        if failures:
            raise failures.pop()
        return clip(*args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip_once_failing)
    before = [p.detach().clone() for p in params]
    with pytest.raises(RuntimeError, match="out of memory"):
        training.apply_synced()
    assert left == [signal.SIGTERM] and not training.sync_due() and training.replicas.has_result()
    training.close()
    assert training.optimizer.version == 0 and all(torch.equal(b, p) for b, p in zip(before, params))
    assert saves == []


def test_a_port_another_group_shares_is_refused_before_the_replicas_start(tmp_path):
    """Replicas bind the public port with SO_REUSEPORT, which any socket bound so (another
    group's, an old group still running through a redeploy) shares with them: the kernel
    would spread connections over both servers. The agent and each node's first replica
    refuse a port anything listens on."""
    import socket
    import subprocess
    import sys

    from server.replicas import ensure_port_free

    port = free_port()
    with socket.socket() as other_group:
        other_group.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        other_group.bind(("127.0.0.1", port))
        other_group.listen()
        with pytest.raises(OSError, match=f"port {port} on 127.0.0.1 is in use"):
            ensure_port_free("127.0.0.1", port)
        root = Path(__file__).resolve().parents[1]
        run = subprocess.run([sys.executable, "-m", "server.cli", "serve", *_flags(tmp_path), "--host", "127.0.0.1",
                              "--port", str(port)], cwd=root, capture_output=True, text=True, timeout=120,
                             env={**os.environ, "PYTHONPATH": str(root)})
    assert run.returncode == 2 and f"port {port} on 127.0.0.1 is in use" in run.stderr, run.stderr[-2000:]
    assert "starting 2 replicas" not in run.stderr
    ensure_port_free("127.0.0.1", port)  # free again


def test_a_host_the_server_cannot_bind_is_a_start_up_error_before_the_model_loads():
    """A host that does not resolve, or is no address of this machine, failed after the
    model loaded, with uvicorn's words and exit code 3, naming no setting (a review of the
    configuration). The probe that refuses a port in use refuses them first."""
    import errno
    import socket
    import subprocess
    import sys
    from unittest import mock

    from server.replicas import ensure_port_free

    port = free_port()
    with pytest.raises(OSError, match="server.host .* 'not a host' does not resolve"):
        ensure_port_free("not a host", port)
    with pytest.raises(OSError, match="server.host .* '192.0.2.1' is no address of this machine"):
        ensure_port_free("192.0.2.1", port)  # TEST-NET-1: documentation's, never a machine's
    ensure_port_free("localhost", port)  # a family the machine may lack is skipped, as asyncio skips it
    real_socket = socket.socket

    def without_ipv6(family=socket.AF_INET, *args):
        if family == socket.AF_INET6:
            raise OSError(errno.EAFNOSUPPORT, "Address family not supported by protocol")
        return real_socket(family, *args)

    with mock.patch("server.replicas.socket.socket", without_ipv6):  # a kernel booted with ipv6.disable=1
        ensure_port_free("", port)
        with pytest.raises(OSError, match="is no address of this machine"):
            ensure_port_free("::1", port)
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--host", "192.0.2.1", "--port", str(port)],
                         cwd=root, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(root)})
    assert run.returncode == 2 and "alchemist: start-up error: server.host" in run.stderr, run.stderr[-2000:]
    assert "Application startup" not in run.stderr


def test_the_replicas_bind_an_ipv6_host_as_one_server_does_and_as_the_probe_asks():
    """`--host ::` bound IPv4 and IPv6 under replicas (one server binds IPv6 alone, as
    asyncio does) while the port probe asked IPv6 alone: an IPv4 listener passed it."""
    import socket

    from server.replicas import ensure_port_free, public_socket

    try:
        socket.socket(socket.AF_INET6).close()
    except OSError:
        pytest.skip("this machine has no IPv6")
    port = free_port()
    with socket.socket(socket.AF_INET) as ipv4_server:
        ipv4_server.bind(("0.0.0.0", port))
        ipv4_server.listen()
        ensure_port_free("::", port)
        with public_socket("::", port) as public:
            assert public.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == 1
            with pytest.raises(OSError, match="is in use"):
                ensure_port_free("::", port)


def test_a_single_server_refuses_a_port_in_use_before_it_loads_anything(tmp_path):
    """An outside pass: one server learned its port was taken only once uvicorn bound it,
    after the model, the trainer and a fresh adapter directory (version 0, the ledger) were
    built, and exited 3. Now it is said at once, as the replicas' agent says it."""
    import socket
    import subprocess
    import sys

    port = free_port()
    flags = _flags(tmp_path)
    at = flags.index("--data-parallel-size")
    flags = flags[:at] + flags[at + 2:]  # one server
    with socket.socket() as other_server:
        other_server.bind(("127.0.0.1", port))
        other_server.listen()
        root = Path(__file__).resolve().parents[1]
        run = subprocess.run([sys.executable, "-m", "server.cli", "serve", *flags, "--host", "127.0.0.1",
                              "--port", str(port)], cwd=root, capture_output=True, text=True, timeout=120,
                             env={**os.environ, "PYTHONPATH": str(root)})
    assert run.returncode == 2 and f"port {port} on 127.0.0.1 is in use" in run.stderr, run.stderr[-2000:]
    assert not (tmp_path / "adapters").exists()  # nothing built, nothing written


def _gone_or_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] == "Z"
    except (FileNotFoundError, IndexError):
        return True


def test_a_replica_dies_with_its_agent_even_while_it_waits_for_its_group(tmp_path):
    """`kill -9` of the agent while its replicas start: a replica sets the parent-death
    signal before anything that waits (the model's conversion, the group's forming), so none
    is left behind (an outside pass found replicas orphaned for the group's 30-minute start
    timeout). Here rank 1 of 2 waits for a group whose rank 0 never comes."""
    import subprocess
    import sys

    tiny_model().save_pretrained(tmp_path / "model")
    tiny_tokenizer().save_pretrained(tmp_path / "model")
    agent = tmp_path / "agent.py"
    agent.write_text(
        "import os, subprocess, sys, time\n"
        "os.environ['ALCHEMIST_AGENT_PID'] = str(os.getpid())  # as `alchemist serve -dp N` names itself\n"
        f"replica = subprocess.Popen([sys.executable, '-m', 'server.cli', 'serve', '--device', 'cpu', "
        f"'--model', {str(tmp_path / 'model')!r}, '--max-model-len', '512'])\n"
        "print(replica.pid, flush=True)\n"
        "time.sleep(600)\n")
    root = Path(__file__).resolve().parents[1]
    group = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    process = subprocess.Popen([sys.executable, str(agent)], stdout=subprocess.PIPE, cwd=root,
                               env={**os.environ, "PYTHONPATH": str(root), **group})
    try:
        replica = int(process.stdout.readline())
        time.sleep(5)  # importing, then waiting for rank 0 (or, on a slow machine, still importing: then
        assert not _gone_or_zombie(replica)  # it finds its agent gone when it checks, and exits all the same)
    finally:
        process.kill()
        process.wait()
    try:
        wait_for(lambda: _gone_or_zombie(replica), timeout=60)
    finally:
        if not _gone_or_zombie(replica):
            os.kill(replica, signal.SIGKILL)


@pytest.mark.parametrize("agent_alive", [True, False], ids=["its-parent", "gone"])
def test_a_replica_whose_agent_is_gone_before_it_starts_exits(agent_alive):
    """The agent names itself (ALCHEMIST_AGENT_PID): a replica whose parent is no longer it
    exits; one whose parent is, runs on — also where the agent is PID 1, in a container."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    agent = os.getpid() if agent_alive else 2 ** 22 + 7  # the test process is the replica's parent
    run = subprocess.run([sys.executable, "-c", "from server.replicas import die_with_parent; die_with_parent(); "
                          "print('serving')"], cwd=root, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(root), "ALCHEMIST_AGENT_PID": str(agent)})
    if agent_alive:
        assert run.returncode == 0 and run.stdout.strip() == "serving", run.stderr
    else:
        assert run.returncode != 0 and f"(pid {agent}) is gone" in run.stderr



@pytest.mark.slow  # a group of two server processes
def test_a_conversation_continues_across_replicas_that_store_their_own_responses(tmp_path):
    """Without an adapter directory each replica stores the responses it served (in memory):
    a turn continued on the other replica is fetched from the one that stored it, a
    conversation may hop between them, and either answers for any stored response."""
    with server_process(*_flags(tmp_path, training=False), env={"OMP_NUM_THREADS": "1"}) as (url, launcher):
        addresses = _private_addresses(launcher.log_path, 2)
        clients = {rank: openai.OpenAI(base_url=f"http://{address}/v1", api_key="unused", max_retries=0)
                   for rank, address in addresses.items()}
        turns, previous = [], None
        for rank in (0, 1, 0):  # each turn on the other replica
            response = clients[rank].responses.create(model="tiny", input=f"turn {len(turns)}", temperature=0,
                                                      max_output_tokens=3, previous_response_id=previous)
            assert response.id.startswith(f"resp_r{rank}-")
            turns.append(response)
            previous = response.id
        chat = clients[1].chat.completions.create(model="tiny", temperature=0, max_tokens=3, messages=[
            message for i, turn in enumerate(turns[:2]) for message in (
                {"role": "user", "content": f"turn {i}"}, {"role": "assistant", "content": turn.output_text})
        ] + [{"role": "user", "content": "turn 2"}])
        assert turns[2].output_text == chat.choices[0].message.content
        assert turns[2].usage.input_tokens == chat.usage.prompt_tokens
        assert clients[0].responses.retrieve(turns[1].id).output_text == turns[1].output_text
        assert [i.content[0].text for i in clients[1].responses.input_items.list(turns[0].id)] == ["turn 0"]
        assert [i.content[0].text for i in clients[1].responses.input_items.list(turns[2].id, limit=1)] == ["turn 2"]
        for odd in (turns[0].id + "?x=1", turns[0].id[:-1] + "#"):  # (an id no replica gave is asked of none)
            with pytest.raises(openai.BadRequestError):
                clients[1].responses.create(model="tiny", input="x", previous_response_id=odd, max_output_tokens=2)
        assert clients[1].responses.delete(turns[0].id) is None  # deleted where it is stored
        with pytest.raises(openai.NotFoundError):
            clients[0].responses.retrieve(turns[0].id)
