"""Data-parallel replicas: one server process per device, on torch.distributed, behind
one port.

`alchemist serve --data-parallel-size N` (`-dp N`) becomes torch's elastic agent
(`torch.distributed.launcher`, what `torchrun` runs): it starts N copies of the same
command, each with `RANK`, `LOCAL_RANK` and `WORLD_SIZE` set, and when one dies it stops
the others and starts the group again (`--max-restarts`) — once a group has served: the
first, failing to start, is not started again. The same program runs under
`torchrun --nproc-per-node N -m server.cli serve …` and across nodes (`torchrun --nnodes`).

Each replica:
  - joins the process group (NCCL on GPUs, gloo on the CPU), with timeouts, so that a
    dead replica fails a collective instead of hanging it, and dies with the agent
    (a parent-death signal): no replica left behind serves the port;
  - serves on the public port through a socket of its own bound with `SO_REUSEPORT`: the
    kernel spreads new connections over the replicas, with no hop in between;
  - also listens on a private port, which the others use to answer what is asked of the
    whole server (server/fanout.py); every replica learns the others' at start.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import logging
import os
import socket
import sys
import uuid

import torch
import torch.distributed as dist

from trainer.replicated import Replica

logger = logging.getLogger(__name__)

# the default group's collectives are the start's (replicas load their models meanwhile,
# each at its own pace); the rounds' have a short timeout of their own (trainer/replicated.py)
START_TIMEOUT_S = 1800


def replica_from_env() -> Replica | None:
    """This process's place in a group started by the elastic agent or `torchrun` (None:
    a single server)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1 or "RANK" not in os.environ:
        return None
    rank = int(os.environ["RANK"])
    return Replica(rank, world_size, int(os.environ.get("LOCAL_RANK", rank)),
                   int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))


def replica_device(device: str, replica: Replica) -> str:
    """The device a replica serves on: `cuda:LOCAL_RANK` where the configured device is
    auto (with a GPU) or cuda; the CPU where it is cpu. One named GPU (cuda:N) is refused."""
    if device.startswith("cuda:"):
        raise ValueError(f"--device {device} names one GPU; with --data-parallel-size each replica takes "
                         "cuda:LOCAL_RANK (use --device cuda, or CUDA_VISIBLE_DEVICES to choose the GPUs)")
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        return f"cuda:{replica.local_rank}"
    return "cpu"


def join_group(replica: Replica, device: str) -> None:
    """Joins the process group (the environment names its rendezvous); on the CPU, the
    node's cores are shared between its replicas unless OMP_NUM_THREADS says otherwise."""
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(torch.device(device))
    elif "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // replica.local_world_size))
    timeout = datetime.timedelta(seconds=START_TIMEOUT_S)
    # the elastic agent's store outlives a restart of the group: a prefix per attempt keeps
    # the new replicas from reading the dead ones' addresses
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500")),
                          replica.world_size,
                          is_master=not agent_store and replica.rank == 0, timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(backend, store=dist.PrefixStore(f"alchemist/attempt-{attempt}", store),
                            rank=replica.rank, world_size=replica.world_size, timeout=timeout)
    logger.info("replica %d of %d joined the group (%s, %s)", replica.rank, replica.world_size, backend, device)


# the environment variable in which `launch` names the agent to its replicas
AGENT_PID_VARIABLE = "ALCHEMIST_AGENT_PID"


def die_with_parent() -> None:
    """SIGTERM to this process when the agent that started it dies (Linux), so that no
    orphaned replica keeps serving the shared port, nor waits for a group that will never
    form. Called first thing in a replica: an agent killed while its replicas start (or
    restart) takes them along. One whose agent (`alchemist serve -dp N`, which names itself
    in the environment; torchrun does not) died before this call, and so is no longer its
    parent, exits now. (Not "the parent is init": in a container the agent is PID 1.)"""
    import ctypes
    import signal

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    agent = os.environ.get(AGENT_PID_VARIABLE)
    if agent is not None and os.getppid() != int(agent):
        raise SystemExit(f"alchemist: the agent that started this replica (pid {agent}) is gone")


def exchange_addresses(own: str) -> list[str]:
    """Every replica's private address, by rank."""
    addresses: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(addresses, own)
    return addresses


def ensure_port_free(host: str, port: int) -> None:
    """Raises OSError, naming the setting, before the model loads: if anything listens on
    the port, on any address `host` names (as the server binds them all); or if `host`
    does not resolve, is no address of this machine, or the port may not be bound. The
    replicas bind it with SO_REUSEPORT, which another group's sockets (or any socket bound
    so) would share with them, the kernel spreading connections over both servers: a
    plain bind fails then. A family the machine lacks is skipped, as asyncio's bind skips
    it (`localhost` without IPv6), unless it is every address the host names."""
    try:
        addresses = socket.getaddrinfo(host or None, port, socket.AF_UNSPEC, socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise OSError(f"server.host (--host) {host!r} does not resolve ({exc.strerror}): give a name or address of "
                      "this machine (0.0.0.0: every IPv4 address)") from None
    unavailable = 0
    for family, kind, protocol, _, address in addresses:
        try:
            with socket.socket(family, kind, protocol) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # connections in TIME_WAIT: no listener
                if family == socket.AF_INET6:  # as asyncio binds it: IPv6 alone, beside IPv4's own socket
                    probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                probe.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise OSError(exc.errno, f"port {port} on {host} is in use ({exc.strerror}): another server "
                                         "listens on it") from None
            if exc.errno == errno.EACCES:
                raise OSError(f"server.port (--port) {port} on {host}: binding it is not permitted "
                              f"({exc.strerror}; below 1024 it takes root or CAP_NET_BIND_SERVICE)") from None
            if exc.errno not in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):  # (a family the kernel lacks)
                raise
            unavailable += 1
    if addresses and unavailable == len(addresses):
        raise OSError(f"server.host (--host) {host!r} is no address of this machine: give one of its own (0.0.0.0: "
                      "every IPv4 address)")


def public_socket(host: str, port: int) -> socket.socket:
    """The public port, shared: each replica binds it with SO_REUSEPORT."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    if family == socket.AF_INET6:  # IPv6 alone, as one server binds it (asyncio) and `ensure_port_free` probes it
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def private_socket(replica: Replica) -> tuple[socket.socket, str]:
    """A port of this replica's own, and the address the others reach it at: loopback on
    one node; across nodes, this host's name (MASTER_ADDR's network)."""
    single_node = replica.local_world_size == replica.world_size
    host = "127.0.0.1" if single_node else "0.0.0.0"
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(256)
    port = sock.getsockname()[1]
    advertised = "127.0.0.1" if single_node else socket.getfqdn()
    return sock, f"{advertised}:{port}"


# the environment variable in which `launch` names the folder where each replica marks that it serves
SERVING_MARKS_VARIABLE = "ALCHEMIST_SERVING_MARKS"


def mark_serving(replica: Replica) -> None:
    """Tells the agent that started this replica (if `launch` did) that it got as far as
    serving: once a group has, a failure restarts it; the first group failing before is
    not restarted (its error would come back at every start)."""
    marks = os.environ.get(SERVING_MARKS_VARIABLE)
    if marks is not None:
        with open(os.path.join(marks, f"rank-{replica.rank}"), "w"):
            pass


LOOPBACK_RENDEZVOUS = "alchemist-loopback"


def _loopback_rendezvous(params):
    """The elastic agent's rendezvous for `launch`'s one node: a store that listens on
    loopback alone. torch's `c10d` rendezvous listens on every interface and unpickles what
    its store holds, so that anyone who reached its port could run code as the server (an
    outside pass did), whatever `--host` and the keys say."""
    from torch.distributed.elastic.rendezvous.api import RendezvousHandler, RendezvousInfo, RendezvousStoreInfo

    class LoopbackRendezvous(RendezvousHandler):
        def __init__(self):
            listener = socket.create_server(("127.0.0.1", 0), backlog=1024)
            self.port = listener.getsockname()[1]
            self.store = dist.TCPStore("127.0.0.1", self.port, None, True, datetime.timedelta(seconds=START_TIMEOUT_S),
                                       multi_tenant=True, master_listen_fd=listener.detach())

        def get_backend(self) -> str:
            return LOOPBACK_RENDEZVOUS

        @property
        def use_agent_store(self) -> bool:  # the replicas' group joins this store
            return True

        def next_rendezvous(self) -> RendezvousInfo:
            return RendezvousInfo(dist.PrefixStore(params.run_id, self.store), 0, 1,
                                  RendezvousStoreInfo("127.0.0.1", self.port))

        def is_closed(self) -> bool:
            return False

        def set_closed(self) -> None:
            pass

        def num_nodes_waiting(self) -> int:
            return 0

        def get_run_id(self) -> str:
            return params.run_id

        def shutdown(self) -> bool:
            self.store = None  # its port closes with it: a group started again gets a store of its own
            return True

    return LoopbackRendezvous()


def launch(argv: list[str], replicas: int, max_restarts: int) -> int:
    """Runs `alchemist <argv>` as `replicas` replica processes under torch's elastic agent
    on this node; returns when the group ends (the exit status: 2 if it never served). A
    group that fails once it has served is started again, up to `max_restarts` times; the
    first one, failing before any replica served, is not: a configuration error, an adapter
    directory another server trains into or a model that does not fit would fail every
    start the same way, each after loading the model again."""
    import gc
    import shutil
    import tempfile

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    logger.info("starting %d replicas (restarted up to %d times once they serve)", replicas, max_restarts)
    rendezvous_handler_registry.register(LOOPBACK_RENDEZVOUS, _loopback_rendezvous)
    # the replicas' collectives connect over loopback too (gloo and NCCL listen on the host's
    # address otherwise), unless the environment says where
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    os.environ[AGENT_PID_VARIABLE] = str(os.getpid())  # the replicas' parent: die_with_parent checks it
    marks = tempfile.mkdtemp(prefix="alchemist-serving-")
    os.environ[SERVING_MARKS_VARIABLE] = marks
    try:
        for attempt in range(max_restarts + 1):
            # the agent's own restarts are off: it restarts whatever failed, at any stage
            config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=replicas, run_id=str(uuid.uuid4()),
                                  rdzv_backend=LOOPBACK_RENDEZVOUS, rdzv_endpoint="", max_restarts=0,
                                  monitor_interval=0.5)
            try:
                elastic_launch(config, entrypoint=sys.executable)("-m", "server.cli", *argv)
                return 0
            except SignalException as exc:  # SIGTERM or SIGINT: the agent stopped the replicas, which saved
                logger.info("the replicas stopped on signal %s", exc.sigval.name)
                return 0
            except ChildFailedError as exc:
                if not os.listdir(marks):  # (marks stay from the first group that served)
                    logger.error("the replicas failed to start, so they are not restarted; the first error above "
                                 "says why: %s", _first_failure(exc))
                    return 2
                if attempt == max_restarts:
                    logger.error("the replicas stopped, restarted %d times: %s", attempt, _first_failure(exc))
                    return 1
                logger.warning("a replica failed (%s); starting the group again (restart %d of %d)",
                               _first_failure(exc), attempt + 1, max_restarts)
                gc.collect()  # the failed group's store (in the agent's reference cycles) stops listening
        return 1
    finally:
        shutil.rmtree(marks, ignore_errors=True)


def _first_failure(exc) -> str:
    """The failed group's first replica failure, in a line: its rank, exit code or signal."""
    rank, failure = exc.get_first_failure()
    return f"replica {rank} exited with {failure.signal_name() if failure.exitcode < 0 else failure.exitcode}"
