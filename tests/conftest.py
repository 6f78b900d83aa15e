"""Shared fixtures; test markers for optional heavy dependencies are chosen automatically."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _has_cuda() -> bool:
    if not _has("torch"):
        return False
    import torch

    return bool(torch.cuda.is_available())


_AVAILABLE = {
    "megatron": _has("megatron.core") and _has("torch"),
    "vllm": _has("vllm"),
    "gpu": _has_cuda(),
    "ray": _has("ray"),
}


def _hosts_unavailable() -> str | None:
    """Why hosts (network namespaces, ``launcher.hosts``) cannot be made here; None when they can."""
    from launcher.hosts import HostsUnavailableError, check_available

    try:
        check_available(probe=True)
    except HostsUnavailableError as exc:
        return str(exc)
    return None


SLOW: dict[str, str] = {
    "test_bench_peers.py": "starts a Ray cluster and the peers' servers",
    "test_soak.py": "one node writing and releasing for a minute",
    "test_concurrency.py::test_8_writers_x_200_groups_with_a_concurrent_reader": "eight writers, 1,600 groups",
    "test_node_failure.py::test_run_goes_on_when_one_of_three_nodes_stops": "a run over three nodes, one stopped",
    "test_node_loss.py": "store nodes on hosts, one killed and one cut off for three call timeouts",
    "test_train_unit.py::test_run_ranks_spawns_ranks_with_the_torch_env": "spawns torch ranks",
    "test_train_unit.py::test_sigterm_to_the_rank_launcher_stops_its_local_ranks": "spawns torch ranks",
    "test_connectors_rollout.py::test_module_refuses_a_bad_document_naming_the_field": "three rollout processes",
    "test_lifeline.py": "a launcher process with store nodes, killed; a store node left running",
    "test_flight_sql.py::test_knit_sql_serves_until_sigterm": "a knit sql process",
    "test_flight_sql.py::test_polars_reads_the_gateway_by_uri": "a polars process reading over TLS",
    "test_resume.py::test_a_run_killed_at_three_points_resumes_and_trains_each_prompt_once": "four starts of knit run",
    "test_worker_loss.py": "knit runs that lose a store node for good and their rollout, taken up again",
}
"""Tests marked ``slow`` here (a module, or one test of it) beside those whose module marks them: processes
that import torch or Ray, clusters, long runs. ``make test-fast`` leaves them out; ``ray`` tests are slow too."""


def _slow_keys(item: pytest.Item) -> list[str]:
    module = item.path.name
    return [key for key in (module, f"{module}::{getattr(item, 'originalname', item.name)}") if key in SLOW]


def pytest_itemcollected(item: pytest.Item) -> None:
    """Mark the :data:`SLOW` tests and the ``ray`` tests ``slow`` as they are collected (before ``-m`` selects)."""
    if _slow_keys(item) or "ray" in item.keywords:
        item.add_marker(pytest.mark.slow)


def pytest_sessionstart(session: pytest.Session) -> None:
    """Every :data:`SLOW` entry names a test that exists: one renamed would silently join the fast set."""
    here = Path(__file__).parent
    stale = [key for key in SLOW if not (here / key.split("::")[0]).is_file()
             or ("::" in key and f"def {key.split('::')[1]}(" not in (here / key.split("::")[0]).read_text())]
    if stale:
        msg = f"tests/conftest.py SLOW names tests that do not exist: {stale}"
        raise pytest.UsageError(msg)


@pytest.hookimpl(trylast=True)  # after -m deselected: a run without hosts tests probes no namespace
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    no_hosts = _hosts_unavailable() if any("hosts" in item.keywords for item in items) else None
    for item in items:
        for marker, ok in _AVAILABLE.items():
            if marker in item.keywords and not ok:
                item.add_marker(pytest.mark.skip(reason=f"needs {marker} (not available here)"))
        if "hosts" in item.keywords and no_hosts:
            item.add_marker(pytest.mark.skip(reason=f"needs hosts as network namespaces: {no_hosts}"))


@pytest.fixture
def make_hosts():  # type: ignore[no-untyped-def]
    """Factory: ``make_hosts(n)`` -> ``launcher.hosts.Hosts`` of n hosts, entered; torn down after the test.

    Skips the test, saying why, where namespaces cannot be made (checked before, and when making them).
    """
    from launcher.hosts import Hosts, HostsUnavailableError

    made: list[Hosts] = []

    def make(n: int) -> Hosts:
        hosts = Hosts(n)
        try:
            hosts.__enter__()
        except HostsUnavailableError as exc:
            pytest.skip(f"needs hosts as network namespaces: {exc}")
        made.append(hosts)
        return hosts

    yield make
    for hosts in made:
        hosts.teardown()


# ---- store nodes (flight_store) ------------------------------------------------------------------


@pytest.fixture
def store_nodes():  # type: ignore[no-untyped-def]
    """Factory: ``store_nodes(n, config=None)`` starts n real StoreServer nodes in-process.

    Each node runs ``config`` (a ``ServerConfig``; default: loopback, port 0, unlimited memory).
    Returns the list of servers (``server.location`` is each node's name); all are shut down after
    the test.
    """
    from flight_store.config import ServerConfig
    from flight_store.server import StoreServer

    started: list[StoreServer] = []

    def start(n: int = 1, config: ServerConfig | None = None) -> list[StoreServer]:
        servers = [StoreServer(config) for _ in range(n)]
        started.extend(servers)
        return servers

    yield start
    for server in started:
        server.shutdown()


@pytest.fixture
def node_process(tmp_path_factory):  # type: ignore[no-untyped-def]
    """Factory: ``node_process(config) -> (proc, location)`` runs ``python -m flight_store --config FILE``.

    ``config`` (a ``ServerConfig``) is written as a document to a fresh temporary file; the factory
    returns once the node printed ``knit serve: listening on <location>`` (its stdout stays open for
    further lines, stderr is discarded). Nodes still running after the test are terminated.
    """
    from flight_store.node import NodeProcess

    started: list[NodeProcess] = []

    def start(config: object) -> tuple[object, str]:
        node = NodeProcess(config, tmp_path_factory.mktemp("node"))  # type: ignore[arg-type]
        started.append(node)
        return node.proc, node.location

    yield start
    for node in started:
        node.stop()



@pytest.fixture
def make_group():  # type: ignore[no-untyped-def]
    """Factory: ``make_group(group_id, size=4, response_len=8, **fields)`` -> a trajectory RecordBatch."""
    from schemas.records import TrajectoryRecord, records_to_batch

    def make(group_id: str, size: int = 4, response_len: int = 8, start: int = 0, **fields: object):  # type: ignore[no-untyped-def]
        recs = [
            TrajectoryRecord(
                group_id=group_id,
                sample_idx=start + i,
                policy_version=int(fields.get("policy_version", 0)),  # type: ignore[call-overload]
                prompt_ids=list(range(1, 5)),
                response_ids=[(7 * i + j) % 1000 for j in range(response_len)],
                response_logprobs=[-0.5] * response_len,
                reward=float(i % 2),
                **{k: v for k, v in fields.items() if k != "policy_version"},  # type: ignore[arg-type]
            )
            for i in range(size)
        ]
        return records_to_batch(recs)

    return make


@pytest.fixture
def spread_ids():  # type: ignore[no-untyped-def]
    """Factory: ``spread_ids(client, n)`` -> ``n`` group ids owned by the client's nodes in turn.

    Routing hashes the nodes' locations, whose ports are random; fixed ids could all land on one node.
    """

    def spread(client, n: int) -> list[str]:  # type: ignore[no-untyped-def]
        by_node: dict[str, list[str]] = {node: [] for node in client.nodes}
        for gid in (f"g{i}" for i in range(50 * n)):
            by_node[client.node_for(gid)].append(gid)
        return [gid for taken in zip(*by_node.values(), strict=False) for gid in taken][:n]

    return spread
