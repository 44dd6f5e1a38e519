"""What the benchmarks' reports mean: `bench colocate`'s window (what it reports of the
measured trace is the trace's alone, not the warm-up's, on `run_condition` itself with a
server that answers as the real one's metrics do: a real one takes minutes per round),
the machine every JSON report names, and a sweep length that runs out of device memory."""

import contextlib
import types

import bench.colocate as colocate
from bench.traces import make_trace
from trainer.status import SLICE_BUCKETS


class _FakeServer:
    """Counters as a training server exports them: the warm-up's labelled entries train, one
    in a cold 0.30 s slice, a second after the warm-up ends (the second scrape), or during the
    trace if it starts first; the trace's own entries train during it, in 0.04 s slices."""

    def __init__(self):
        self.trained = self.ready = self.between = 0
        self.longest, self.item = 0.0, ""
        self.slices = {bound: 0 for bound in SLICE_BUCKETS}
        self.traces = self.scrapes = 0

    def train(self, entries: int, seconds: float, item: str) -> None:
        self.trained += entries
        self.slices[next(bound for bound in SLICE_BUCKETS if seconds <= bound)] += entries
        if seconds > self.longest:
            self.longest, self.item = seconds, item

    def metrics(self) -> str:
        self.scrapes += 1
        if self.traces == 1 and self.scrapes == 2:  # a second after the warm-up: caught up
            self.train(self.ready, 0.30, "dpo reuse job (cold)")
            self.ready = 0
        cumulative, buckets = 0, []
        for bound, count in self.slices.items():
            cumulative += count
            buckets.append(f'alchemist:train_slice_seconds_bucket{{le="{"+Inf" if bound == float("inf") else bound}"}} '
                           f'{cumulative}')
        return "\n".join([
            "# TYPE alchemist:trained_entries counter",
            f'alchemist:trained_entries_total{{mode="dpo",path="reuse"}} {self.trained}',
            "# TYPE alchemist:activation_cache_entries gauge",
            f'alchemist:activation_cache_entries{{state="ready"}} {self.ready}',
            'alchemist:activation_cache_entries{state="training"} 0',
            "# TYPE alchemist:train_slice_max_seconds gauge",
            f'alchemist:train_slice_max_seconds{{item="{self.item}"}} {self.longest}',
            "# TYPE alchemist:train_slice_seconds histogram", *buckets,
            "# TYPE alchemist:arbiter_slices counter",
            f'alchemist:arbiter_slices_total{{gap="between_steps",policy="idle"}} {self.between}', ""])

    async def run_trace(self, url, trace, feedback, seed, feedback_fraction=1.0):
        self.traces += 1
        if self.traces == 1:  # the warm-up: labelled, not trained yet when it ends
            self.ready, self.between = len(trace), self.between + 5
        else:
            if self.ready:  # the warm-up's, not waited for
                self.train(self.ready, 0.30, "dpo reuse job (cold)")
                self.ready = 0
            self.train(len(trace), 0.04, "dpo reuse job")
            self.between += 2
        return [{"ttft": 0.1, "tpot": 0.05, "tokens": 10} for _ in trace]


def test_the_measured_trace_reports_its_own_entries_slices_and_between_step_slices(monkeypatch):
    """A review: the warm-up's labelled entries trained in the measured window and were
    counted with it ("35 of 35" from a 29-request trace), its cold first job was the
    "longest training slice", and between-step slices were the server's lifetime count."""
    server = _FakeServer()
    monkeypatch.setattr(colocate, "running_server", contextlib.contextmanager(lambda *flags, env=None: iter(["x"])))
    monkeypatch.setattr(colocate, "run_trace", server.run_trace)
    monkeypatch.setattr(colocate.httpx, "get", lambda url, **kwargs: types.SimpleNamespace(text=server.metrics()))
    monkeypatch.setattr(colocate, "steps_by_kind", lambda before, after: {})
    trace, warmup = make_trace(0.25, 60, 0), make_trace(0.25, 15, 1000, at_least_one=True)
    result = colocate.run_condition(True, colocate.TrainingSide(), trace, 0, 60, warmup)
    assert sum(result["trained_by_path"].values()) == len(trace)
    assert result["between_step_slices"] == 2
    assert (result["train_slice_max_s"], result["train_slice_max_item"]) == (0.05, "")  # the bound holding 0.04 s


def test_every_json_report_names_the_machine_it_ran_on_and_writes_no_nan(tmp_path):
    """Figures are named with their device: several GPU reports said "cuda:0" or nothing,
    the device's name only in gpu.sh's log (a review)."""
    import json

    from bench.report import machine_name, write_json

    path = tmp_path / "report.json"
    write_json({"ratio": float("nan"), "steps": [1.0, float("inf")]}, str(path))
    assert json.loads(path.read_text()) == {"ratio": None, "steps": [1.0, None], "machine": machine_name()}
    assert machine_name()


def test_a_length_that_runs_out_of_device_memory_is_a_row_and_leaves_the_next_length_nothing_queued(
        tmp_path, monkeypatch):
    """`bench training --sweep` on a GPU: the length whose prefill ran out of memory is
    reported as such, and its request does not stay queued for the next length to step
    first (a review of the CUDA-only paths)."""
    import dataclasses

    import torch

    import bench.training as training
    from engine.sampling_params import SamplingParams
    from tests.conftest import make_config
    from tests.tiny import tiny_model, tiny_tokenizer

    tiny_model("llama").config.save_pretrained(tmp_path / "shape")
    tiny_tokenizer().save_pretrained(tmp_path / "tok")
    config = make_config()
    config = dataclasses.replace(config, model=dataclasses.replace(
        config.model, model=str(tmp_path / "shape"), tokenizer=str(tmp_path / "tok"), load_format="dummy",
        dtype="float32", device="cpu"))
    queued_when_measured = []

    def measure(bench, mode, tokens, repeats, stale):
        queued_when_measured.append(list(bench.engine.request_ids()))
        if tokens == 32:  # a prefill queued, then out of memory
            bench.engine.add_request("too-long", [5] * tokens, SamplingParams(max_tokens=1))
            raise torch.OutOfMemoryError("CUDA out of memory")
        return {"mode": mode, "tokens": tokens}

    monkeypatch.setattr(training, "measure", measure)
    monkeypatch.setattr(training, "plot_sweep", lambda *args: [])
    summary = training.run_training_bench(config, "cpt", 32, sweep=[32, 48], json_path=str(tmp_path / "r.json"))
    assert summary["results"] == [{"mode": "cpt", "tokens": 32, "out_of_memory": True}, {"mode": "cpt", "tokens": 48}]
    assert queued_when_measured == [[], []]
