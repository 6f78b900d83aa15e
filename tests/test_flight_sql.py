"""The Flight SQL gateway (``flight_store.sql``, ``knit sql``) through the real ADBC Flight SQL driver (Go).

Two real store nodes hold a few groups; a gateway over both answers DB-API queries, a prepared statement with
a parameter, the catalog calls ADBC makes, and ``polars.read_database_uri``; writes are refused; a runaway
query is interrupted by the time limit and by the client's cancel; TLS and the bearer token guard it as they
guard the nodes. Expected values come from the store client's own metadata scan, never from SQL.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow as pa
import pyarrow.flight as flight
import pytest

flightsql = pytest.importorskip("adbc_driver_flightsql.dbapi")
pytest.importorskip("duckdb")

import adbc_driver_flightsql  # noqa: E402
import adbc_driver_manager  # noqa: E402
from test_security import TOKEN, _secured_config, _self_signed  # noqa: E402

from flight_store.config import ClientConfig  # noqa: E402
from flight_store.reading import StoreReader  # noqa: E402
from flight_store.server import StoreServer  # noqa: E402
from flight_store.sql import SqlConfig, SqlGateway  # noqa: E402
from flight_store.sql.tables import VIEWS  # noqa: E402
from flight_store.writing import StoreWriter  # noqa: E402

RUNAWAY = "SELECT count(*) FROM range(1000000000000) a, range(1000) b"
"""A query that runs for hours unless interrupted."""


def _connect(location: str, **db_kwargs: str) -> Any:
    """A DB-API connection (autocommit: the endpoint has no transactions, as its GetSqlInfo says)."""
    return flightsql.connect(location, db_kwargs=db_kwargs or None, autocommit=True)


def _query(location: str, sql: str, params: tuple[Any, ...] | None = None) -> list[tuple[Any, ...]]:
    with _connect(location) as conn, conn.cursor() as cur:
        cur.execute(sql, params)
        return list(cur.fetchall())


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[list[str], pl.DataFrame]]:
    """Two nodes holding 12 groups (4 samples each) of two tasks and three policy versions; one group released.
    Yields the nodes' locations and their metadata as the store client scans it."""
    from schemas.records import TrajectoryRecord, records_to_batch

    with StoreServer() as a, StoreServer() as b, StoreWriter([a.location, b.location]) as writer, \
            StoreReader.sharing(writer) as reader:
        for g in range(12):
            writer.put_group(records_to_batch([TrajectoryRecord(
                group_id=f"g{g}", sample_idx=i, policy_version=g % 3, data_source=("math", "code")[g % 2],
                prompt_ids=[1, 2, 3], response_ids=list(range(1 + (g + i) % 5)),
                response_logprobs=[-0.5] * (1 + (g + i) % 5), reward=float((g * 4 + i) % 3)) for i in range(4)]))
        reader.release(["g0"])
        yield [a.location, b.location], reader.scan_metadata()


@pytest.fixture(scope="module")
def gateway(cluster: tuple[list[str], pl.DataFrame]) -> Iterator[SqlGateway]:
    with SqlGateway(SqlConfig(stores=cluster[0], snapshot_max_age_s=0)) as gw:
        yield gw


def test_dbapi_queries_answer_over_every_node(gateway: SqlGateway, cluster: tuple[list[str], pl.DataFrame]) -> None:
    nodes, meta = cluster
    by_node = _query(gateway.location, "SELECT node, count(*), sum(prompt_len + response_len) FROM trajectories "
                                       "GROUP BY node ORDER BY node")
    want = meta.group_by("node").agg(pl.len(), (pl.col("prompt_len") + pl.col("response_len")).sum()).sort("node")
    assert by_node == [tuple(r) for r in want.iter_rows()]
    assert len(by_node) == 2 and {r[0] for r in by_node} == set(nodes)

    reward = _query(gateway.location, "SELECT policy_version, avg(reward) FROM trajectories GROUP BY 1 ORDER BY 1")
    want_reward = meta.group_by("policy_version").agg(pl.col("reward").mean()).sort("policy_version")
    assert [(v, pytest.approx(r)) for v, r in want_reward.iter_rows()] == reward

    groups = _query(gateway.location, "SELECT group_id, samples, released FROM groups ORDER BY group_id")
    assert len(groups) == 12 and all(n == 4 for _, n, _ in groups)
    assert [g for g, _, released in groups if released] == ["g0"]
    assert _query(gateway.location, "SELECT count(*) FROM nodes WHERE reachable AND groups_released = 1") == [(1,)]


def test_a_release_shows_in_the_next_query(gateway: SqlGateway, cluster: tuple[list[str], pl.DataFrame]) -> None:
    """The tables are live: a snapshot older than ``snapshot_max_age_s`` (0 here) is read again."""
    sql = "SELECT count(*) FROM groups WHERE released"
    before = _query(gateway.location, sql)[0][0]
    with StoreReader(cluster[0]) as reader:
        reader.release(["g1"])
    assert _query(gateway.location, sql) == [(before + 1,)]


def test_a_prepared_statement_takes_a_parameter(gateway: SqlGateway, cluster: tuple[list[str], pl.DataFrame]) -> None:
    meta = cluster[1]
    sql = "SELECT count(*), min(policy_version), max(policy_version) FROM trajectories WHERE policy_version = ?"
    with _connect(gateway.location) as conn, conn.cursor() as cur:
        for version in (1, 2, 7):
            cur.execute(sql, (version,))  # prepared once, bound and executed three times
            n = meta.filter(pl.col("policy_version") == version).height
            assert cur.fetchall() == [(n, version if n else None, version if n else None)]
        for query, names in [(sql, ["1"]), ("SELECT * FROM groups WHERE samples > $2 AND data_source = $1", ["1", "2"]),
                             ("SELECT data_source, count(*) AS n FROM trajectories GROUP BY 1", [])]:
            cur.adbc_statement.set_sql_query(query)
            cur.adbc_statement.prepare()
            assert pa.Schema._import_from_c_capsule(  # type: ignore[attr-defined]
                cur.adbc_statement.get_parameter_schema().__arrow_c_schema__()).names == names


def test_catalog_calls(gateway: SqlGateway) -> None:
    with _connect(gateway.location) as conn:
        info = conn.adbc_get_info()
        assert info["vendor_name"] == "knittrans" and info["vendor_arrow_version"] == pa.__version__
        assert conn.adbc_get_table_types() == ["TABLE"]
        objects = conn.adbc_get_objects().read_all().to_pylist()
        assert [c["catalog_name"] for c in objects] == ["knit"]
        (schema,) = objects[0]["catalog_db_schemas"]
        assert schema["db_schema_name"] == "main"
        tables = {t["table_name"]: [c["column_name"] for c in t["table_columns"]] for t in schema["db_schema_tables"]}
        assert sorted(tables) == sorted(VIEWS)
        assert {"node", "group_id", "reward", "policy_version", "released"} <= set(tables["trajectories"])
        assert conn.adbc_get_table_schema("groups").names == tables["groups"]
        filtered = conn.adbc_get_objects(table_name_filter="traj%").read_all().to_pylist()
        assert [t["table_name"] for t in filtered[0]["catalog_db_schemas"][0]["db_schema_tables"]] == ["trajectories"]


def test_writes_and_file_access_are_refused(gateway: SqlGateway) -> None:
    count = _query(gateway.location, "SELECT count(*) FROM trajectories")
    with _connect(gateway.location) as conn, conn.cursor() as cur:
        for sql, kind in [("INSERT INTO trajectories SELECT * FROM trajectories", "INSERT"),
                          ("DELETE FROM trajectories", "DELETE"), ("CREATE TABLE t AS SELECT 1", "CREATE"),
                          ("SET threads = 64", "SET"), ("ATTACH 'x.db' AS x", "ATTACH"),
                          ("COPY trajectories TO 'out.csv'", "COPY")]:
            with pytest.raises(adbc_driver_manager.ProgrammingError, match=rf"read-only.*type {kind}"):
                cur.execute(sql)
        cur.adbc_statement.set_sql_query("UPDATE trajectories SET reward = 1")  # ExecuteUpdate: a DoPut
        with pytest.raises(adbc_driver_manager.ProgrammingError, match=r"read-only.*type UPDATE"):
            cur.adbc_statement.execute_update()
        with pytest.raises(adbc_driver_manager.Error, match="file system operations are disabled"):
            cur.execute("SELECT * FROM read_csv('/etc/hostname')")
        with pytest.raises(adbc_driver_manager.Error, match="exactly one SQL statement"):
            cur.execute("SELECT 1; SELECT 2")
    assert not Path("out.csv").exists() and not Path("x.db").exists()
    assert _query(gateway.location, "SELECT count(*) FROM trajectories") == count


def test_runaway_queries_are_cancelled_and_results_bounded(cluster: tuple[list[str], pl.DataFrame]) -> None:
    """The time limit interrupts a runaway query; so does the client's cancel (well before the limit); a result
    over the row limit fails naming it. The gateway answers the next query."""
    config = SqlConfig(stores=cluster[0], query_timeout_s=1.0, max_result_rows=100, max_queries=1)
    with SqlGateway(config) as gw, _connect(gw.location) as conn, conn.cursor() as cur:
        with pytest.raises(adbc_driver_manager.OperationalError, match=r"longer than query_timeout_s=1.0 s"):
            cur.execute(RUNAWAY)
        assert gw.engine.interrupted == {"timeout": 1, "cancelled": 0}
        with pytest.raises(adbc_driver_manager.Error, match="more than max_result_rows=100"):
            cur.execute("SELECT * FROM range(1000)")
        cur.execute("SELECT count(*) FROM trajectories")
        assert cur.fetchall() == [(cluster[1].height,)]
    with SqlGateway(SqlConfig(stores=cluster[0], query_timeout_s=300)) as gw, _connect(gw.location) as conn, \
            conn.cursor() as cur:
        canceller = threading.Timer(0.5, cur.adbc_cancel)
        canceller.start()
        with pytest.raises(adbc_driver_manager.OperationalError, match="CANCELLED"):
            cur.execute(RUNAWAY)
        canceller.join()
        for _ in range(200):  # the gateway sees the cancelled call and interrupts its query
            if gw.engine.interrupted["cancelled"]:
                break
            time.sleep(0.05)
        assert gw.engine.interrupted == {"timeout": 0, "cancelled": 1}
        cur.execute("SELECT 41 + 1")
        assert cur.fetchall() == [(42,)]


def test_tls_and_token_guard_the_gateway_as_they_guard_the_nodes(tmp_path: Path) -> None:
    cert = _self_signed()
    secured = _secured_config(tmp_path, cert)
    client = ClientConfig(token_file=secured.auth_token_file, tls_root_certs_file=secured.tls_cert_file)
    with StoreServer(secured) as node, SqlGateway(SqlConfig(
            stores=[node.location], client=client, tls_cert_file=secured.tls_cert_file,
            tls_key_file=secured.tls_key_file, auth_token_file=secured.auth_token_file)) as gw:
        assert gw.location.startswith("grpc+tls://")
        roots = {adbc_driver_flightsql.DatabaseOptions.TLS_ROOT_CERTS.value: cert[0].decode()}
        header = adbc_driver_flightsql.DatabaseOptions.AUTHORIZATION_HEADER.value
        with _connect(gw.location, **roots, **{header: f"Bearer {TOKEN}"}) as conn, conn.cursor() as cur:
            cur.execute("SELECT node, reachable FROM nodes")
            assert cur.fetchall() == [(node.location, True)]
        for extra, why in [({}, "no bearer token"), ({header: "Bearer wrong"}, "a wrong bearer token")]:
            with _connect(gw.location, **roots, **extra) as conn, conn.cursor() as cur, \
                    pytest.raises(adbc_driver_manager.Error, match=f"unauthenticated.*{why}"):
                cur.execute("SELECT 1")
        with _connect(gw.location, **{header: f"Bearer {TOKEN}"}) as conn, conn.cursor() as cur, \
                pytest.raises(adbc_driver_manager.Error, match="certificate"):
            cur.execute("SELECT 1")  # the system roots do not trust the gateway's certificate


def test_a_node_that_is_down_is_reported_not_fatal(cluster: tuple[list[str], pl.DataFrame]) -> None:
    with StoreServer() as extra:
        stores = [*cluster[0], extra.location]
        config = SqlConfig(stores=stores, client=ClientConfig(retries=0, timeout_s=5))
        with SqlGateway(config) as gw:
            extra.shutdown()
            rows = _query(gw.location, "SELECT node, reachable FROM nodes ORDER BY node")
            assert dict(rows) == {**dict.fromkeys(cluster[0], True), extra.location: False}
            assert _query(gw.location, "SELECT count(*) FROM trajectories") == [(cluster[1].height,)]


def test_other_protocols_get_a_clear_error(gateway: SqlGateway) -> None:
    with flight.FlightClient(gateway.location) as raw:
        with pytest.raises(flight.FlightServerError, match="not a Flight SQL command"):
            raw.get_flight_info(flight.FlightDescriptor.for_command(b'{"kind": "group"}'))
        with pytest.raises(flight.FlightServerError, match="does not serve the action 'BeginTransaction'"):
            list(raw.do_action(flight.Action("BeginTransaction", b"")))


def test_cancel_flight_info_drops_a_result_not_fetched(gateway: SqlGateway) -> None:
    """The ``CancelFlightInfo`` action (what a client sends when it gives up on a result) lets go of it."""
    from flight_store.sql import protocol

    command = protocol.pack(protocol.make("CommandStatementQuery", query="SELECT 42 AS answer"))
    with flight.FlightClient(gateway.location) as raw:
        info = raw.get_flight_info(flight.FlightDescriptor.for_command(command))
        assert info.schema.names == ["answer"] and info.total_records == 1
        request = protocol.make("CancelFlightInfoRequest", info=info.serialize())
        (reply,) = raw.do_action(flight.Action("CancelFlightInfo", request.SerializeToString()))
        assert protocol.parse("CancelFlightInfoResult", reply.body.to_pybytes()).status == 1  # CANCELLED
        with pytest.raises(flight.FlightServerError, match="no result is held under this handle"):
            raw.do_get(info.endpoints[0].ticket).read_all()


def test_polars_reads_the_gateway_by_uri(cluster: tuple[list[str], pl.DataFrame], tmp_path: Path) -> None:
    """``polars.read_database_uri(..., engine="adbc")`` with a ``flightsql://`` URI (which the driver reads as TLS;
    the Go driver takes its roots from ``SSL_CERT_FILE`` when the process starts, hence a child process)."""
    secured = _secured_config(tmp_path, _self_signed())
    config = SqlConfig(stores=cluster[0], tls_cert_file=secured.tls_cert_file, tls_key_file=secured.tls_key_file)
    with SqlGateway(config) as gw:
        uri = gw.location.replace("grpc+tls://", "flightsql://")
        code = ("import polars as pl\n"
                f"frame = pl.read_database_uri('SELECT node, count(*) AS n FROM trajectories GROUP BY 1', {uri!r}, "
                "engine='adbc')\n"
                "print(frame.sort('node').write_json())")
        # -W ignore: polars opens the DB-API connection with autocommit off, which the driver warns it cannot honour
        out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=120,
                             env={**os.environ, "SSL_CERT_FILE": str(secured.tls_cert_file)}, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    want = cluster[1].group_by("node").agg(pl.len().alias("n")).sort("node")
    assert pl.read_json(out.stdout.encode()).to_dicts() == want.to_dicts()


def test_knit_sql_serves_until_sigterm(cluster: tuple[list[str], pl.DataFrame]) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "launcher", "sql", "--stores", ",".join(cluster[0])],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline() if proc.stdout is not None else ""
        assert "knit sql: listening on grpc://127.0.0.1:" in line, line
        location = line.split("listening on ", 1)[1].strip()
        assert _query(location, "SELECT count(*) FROM trajectories") == [(cluster[1].height,)]
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "knit sql: stopped" in out
