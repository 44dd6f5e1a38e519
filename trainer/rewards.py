"""Rewards computed in the server: `train.reward_function = "module:callable"` (GRPO).

The function is called as `fn(prompt, responses)` — `prompt` the request's messages (a
list of {"role", "content"} dicts) for a chat completion or its text for a completion,
`responses` the n response texts in choice order — and returns n finite numbers. It runs
on worker threads, never on the device thread or the event loop, under
`train.reward_timeout_s`. The rewards are attached exactly as if a client had posted
them (trainer/feedback.py). An exception, a timeout or a bad return drops the group,
logged and counted (`reward_errors`, `alchemist:reward_errors_total`). Each call runs on a
thread of its own, timed from its start; one that never returns keeps its thread (Python
cannot stop it), its group dropped at the timeout all the same, and later calls still run
— until `MAX_RUNNING_CALLS` are running at once, when a group is dropped saying so.
"""

from __future__ import annotations

import collections.abc
import concurrent.futures
import importlib
import logging
import math
import threading
import time
from typing import Callable

from trainer.cache import ActivationCache
from trainer.entries import GroupEntry
from trainer.feedback import FeedbackLabel, FeedbackOutcome, FeedbackResult
from trainer.status import TrainingStats

logger = logging.getLogger(__name__)
# seconds between tries of rewards the feedback ledger could not take (503)
LEDGER_RETRY_S = (1.0, 2.0, 4.0)

# groups scored at once (each waits for its call within the timeout)
_WORKERS = 4
# calls of the function running at once, hung ones included: beyond, none starts
MAX_RUNNING_CALLS = 16


def load_reward_function(spec: str) -> Callable:
    """"package.module:callable" -> the callable; ValueError naming what is wrong."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"train.reward_function must look like 'package.module:function', got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"train.reward_function: cannot import {module_name!r}: {exc}") from exc
    function = getattr(module, attribute, None)
    if not callable(function):
        raise ValueError(f"train.reward_function: {module_name!r} has no callable {attribute!r}")
    return function


def checked_rewards(value, count: int) -> list[float]:
    """The function's return as `count` finite floats; ValueError otherwise."""
    try:
        if isinstance(value, (collections.abc.Mapping, str, bytes)):  # a dict would be scored by its keys
            raise TypeError("not a sequence of numbers")
        items = list(value)
        if any(isinstance(r, (str, bytes, bool)) for r in items):  # float() takes "1" and True: not numbers
            raise TypeError("not numbers")
        rewards = [float(r) for r in items]
    except (TypeError, ValueError) as exc:
        raise ValueError(f"the reward function must return {count} numbers, returned {value!r}") from exc
    if len(rewards) != count or not all(math.isfinite(r) for r in rewards):
        raise ValueError(f"the reward function must return {count} finite numbers, returned {value!r}")
    return rewards


class RewardScorer:
    def __init__(self, function: Callable, timeout_s: float, cache: ActivationCache, stats: TrainingStats,
                 submit: Callable[[FeedbackLabel], FeedbackResult], decode: Callable[[list[int]], str],
                 on_scored: Callable[[], None] = lambda: None):
        """`submit`: attaches rewards as feedback does (`FeedbackIntake.submit`);
        `decode`: prompt token ids -> text, for requests that came without the client's
        prompt; `on_scored`: called after rewards are attached (wakes the engine's loop)."""
        self.function = function
        self.timeout_s = timeout_s
        self.cache = cache
        self.stats = stats
        self.submit = submit
        self.decode = decode
        self.on_scored = on_scored
        self._waits = concurrent.futures.ThreadPoolExecutor(_WORKERS, thread_name_prefix="reward-wait")
        self._running = 0  # calls of the function running now (hung ones too)
        self._lock = threading.Lock()

    def score(self, entry: GroupEntry, prompt, texts: list[str]) -> None:
        """Scores a finished group off this thread; its rewards are attached when they
        come. `prompt`: the client's messages or text (None: decoded from the entry)."""
        if prompt is None:
            prompt = self.decode(entry.prompt_token_ids)
        self._waits.submit(self._run, entry, prompt, texts)

    def _run(self, entry: GroupEntry, prompt, texts: list[str]) -> None:
        try:
            rewards = checked_rewards(self._call(prompt, list(texts)), len(texts))
        except Exception as exc:  # noqa: BLE001 - the user's function may raise anything
            reason = f"timed out after {self.timeout_s:g} s" if isinstance(exc, TimeoutError) else repr(exc)
            logger.error("reward function failed for %s (%s); the group is dropped", entry.completion_id, reason)
            with self.stats.lock:
                self.stats.reward_errors += 1
            self.cache.drop_unlabelled(entry)
            return
        label = FeedbackLabel(entry.completion_id, rewards=rewards, source="reward_function")
        result = self.submit(label)
        for wait_s in LEDGER_RETRY_S:  # the feedback ledger could not be written: as a client would, retry
            if result.outcome is not FeedbackOutcome.UNAVAILABLE:
                break
            time.sleep(wait_s)
            result = self.submit(label)
        if not result.accepted:
            logger.warning("rewards for %s not attached: %s", entry.completion_id, result.message)
        self.on_scored()

    def _call(self, prompt, texts: list[str]):
        """The function's return, on a thread of its own, within the timeout from the call's
        start (a pool's queue counted against it, and four hung calls held the pool: every
        later group was dropped as timed out, its function never called)."""
        with self._lock:
            if self._running >= MAX_RUNNING_CALLS:
                raise RuntimeError(f"{self._running} calls of the reward function are still running (past their "
                                   "timeout: hung?); no other starts until one returns")
            self._running += 1
        returned: concurrent.futures.Future = concurrent.futures.Future()

        def call() -> None:
            try:
                returned.set_result(self.function(prompt, texts))
            except BaseException as exc:  # noqa: BLE001 - whatever it raises is its group's failure
                returned.set_exception(exc)
            finally:
                with self._lock:
                    self._running -= 1

        threading.Thread(target=call, name="reward", daemon=True).start()
        return returned.result(timeout=self.timeout_s)

    def close(self) -> None:
        self._waits.shutdown(wait=False, cancel_futures=True)
