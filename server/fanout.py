"""What a replica asks the others (server/replicas.py), so that whatever a client asks on
the shared port is answered for the whole server, not for the replica its connection
landed on:

  - `/metrics`: every replica's samples, each with an `engine` label (its rank, vLLM's
    name for a data-parallel rank), in one exposition — those that answered within
    `METRICS_PEER_TIMEOUT_S`, with `alchemist:replica_up` saying which did (a hung or
    restarting replica must not take every replica's samples out of the scrape);
  - `/v1/adapters`: rank 0's answer, with every replica's version and weights' digest;
  - a label, or a deletion, for a completion another replica served: sent on to that
    replica, whose answer is the client's (the label trains where its recording is);
  - a rollback: sent on to rank 0, which rolls every replica back at one round.

A request that is itself a replica's question carries `LOCAL_HEADER` and is answered for
the replica it reached.
"""

from __future__ import annotations

import asyncio
import logging

import httpx
from fastapi import Request, Response
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from server.errors import APIError

logger = logging.getLogger(__name__)
logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per question between replicas

LOCAL_HEADER = "x-alchemist-replica-local"
# the client's headers a replica passes on with its question
_PASSED_HEADERS = ("authorization", "content-type", "x-request-id")
PEER_TIMEOUT_S = 60.0
# how long a scrape waits for each other replica: under Prometheus's scrape timeout (10 s by default,
# 5 s in configs/grafana/prometheus.yml), so that the replicas that answer are scraped
METRICS_PEER_TIMEOUT_S = 2.0
# how long a status read (`GET /v1/adapters`) waits for the other replicas before its 503: a
# hung one must not hold it for PEER_TIMEOUT_S (an outside pass: no answer in 40 s)
STATUS_PEER_TIMEOUT_S = 10.0
REPLICA_UP = "alchemist:replica_up"


class Peers:
    def __init__(self, rank: int, addresses: list[str]):
        """`addresses`: every replica's private host:port, by rank."""
        self.rank = rank
        self.addresses = addresses
        self.private_port = int(addresses[rank].rsplit(":", 1)[1])
        self._client: httpx.AsyncClient | None = None
        # the replicas the last `ask_each` got no answer from (logged as the set changes)
        self._silent: set[int] = set()

    @property
    def world_size(self) -> int:
        return len(self.addresses)

    def is_local(self, request: Request) -> bool:
        """The request is another replica's question about this one (on the private port:
        a client cannot make the public one answer for a single replica)."""
        server = request.scope.get("server") or (None, None)
        return request.headers.get(LOCAL_HEADER) == "1" and server[1] == self.private_port

    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=PEER_TIMEOUT_S)
        return self._client

    async def ask(self, rank: int, request: Request, path: str | None = None, body: bytes | None = None,
                  method: str | None = None, params: dict | None = None) -> httpx.Response:
        """`request` (or `method` `path` with its headers, and `params` as its query), as
        another replica's question to `rank`; a replica that cannot be reached is a 503 for
        the client, to send again."""
        headers = {k: v for k, v in request.headers.items() if k.lower() in _PASSED_HEADERS}
        headers[LOCAL_HEADER] = "1"
        url = f"http://{self.addresses[rank]}{path or request.url.path}"
        try:
            return await self.client().request(method or request.method, url, headers=headers, content=body,
                                               params=params if path else request.query_params)
        except httpx.HTTPError as exc:
            raise APIError(503, f"replica {rank} did not answer ({type(exc).__name__}); it may be restarting: "
                                "send the request again", code="replica_unavailable",
                           headers={"Retry-After": "1"}) from None

    async def forward(self, rank: int, request: Request, body: bytes) -> Response:
        """The client's request answered by replica `rank`, as that replica answered it."""
        answer = await self.ask(rank, request, body=body)
        headers = {k: v for k, v in answer.headers.items() if k.lower() in ("content-type", "retry-after")}
        return Response(answer.content, answer.status_code, headers=headers)

    async def ask_all(self, request: Request, path: str, method: str | None = None,
                      timeout_s: float = PEER_TIMEOUT_S) -> list[httpx.Response]:
        """`path` asked of every other replica, by rank (this one's slot is None); a 503 if
        one does not answer within `timeout_s`."""
        others = [r for r in range(self.world_size) if r != self.rank]

        async def answer_of(rank: int) -> httpx.Response:
            try:
                return await asyncio.wait_for(self.ask(rank, request, path, method=method), timeout_s)
            except asyncio.TimeoutError:
                raise APIError(503, f"replica {rank} did not answer {path} within {timeout_s:.0f} s (hung, or busy "
                                    "with a long step); send the request again", code="replica_unavailable",
                               headers={"Retry-After": "1"}) from None

        answers = await asyncio.gather(*(answer_of(r) for r in others))
        result: list = [None] * self.world_size
        for rank, answer in zip(others, answers):
            if not answer.is_success:
                raise APIError(503, f"replica {rank} answered {path} with {answer.status_code}; send the request "
                                    "again", code="replica_unavailable", headers={"Retry-After": "1"})
            result[rank] = answer
        return result

    async def ask_each(self, request: Request, path: str, timeout_s: float) -> dict[int, httpx.Response | None]:
        """`path` asked of every other replica at once: by rank, its 2xx answer, or None
        where it gave none within `timeout_s` (hung, restarting, failed)."""
        async def answer_of(rank: int) -> httpx.Response | None:
            try:
                answer = await asyncio.wait_for(self.ask(rank, request, path, method="GET"), timeout_s)
            except (APIError, asyncio.TimeoutError):
                return None
            return answer if answer.is_success else None

        others = [r for r in range(self.world_size) if r != self.rank]
        answers = dict(zip(others, await asyncio.gather(*(answer_of(r) for r in others))))
        silent = {rank for rank, answer in answers.items() if answer is None}
        if silent - self._silent:
            logger.warning("replicas %s did not answer %s within %.0f s: left out of it", sorted(silent - self._silent),
                           path, timeout_s)
        if self._silent - silent:
            logger.info("replicas %s answer %s again", sorted(self._silent - silent), path)
        self._silent = silent
        return answers

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()


def merge_metrics(expositions: list[str | None]) -> bytes:
    """Replicas' Prometheus expositions (by rank; None: it did not answer) as one, each
    sample labelled with its replica's rank as `engine`, and `alchemist:replica_up`."""
    families: dict[str, Metric] = {}
    up = Metric(REPLICA_UP, "Whether the replica answered this scrape (1) or not in time (0: its samples are "
                "missing from it)", "gauge")
    for rank, text in enumerate(expositions):
        up.add_sample(REPLICA_UP, {"engine": str(rank)}, float(text is not None))
        for family in text_string_to_metric_families(text or ""):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation, family.type,
                                                        family.unit)
            for sample in family.samples:
                merged.add_sample(sample.name, {**sample.labels, "engine": str(rank)}, sample.value,
                                  sample.timestamp, sample.exemplar)

    class _Merged:
        def collect(self):
            return [*families.values(), up]

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged())
    return generate_latest(registry)
