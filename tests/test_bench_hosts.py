"""``--hosts`` of the benchmarks: parsed, recorded in ``params.network``, refused with the reason where hosts
cannot be made; and (where network namespaces can be made) one benchmark run across two hosts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import bench._hosts
from bench._hosts import STORE_HOST_ENV, network_mode
from launcher.hosts import HostsUnavailableError

ROOT = Path(__file__).resolve().parents[1]


def test_network_mode_is_recorded_from_the_store_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(STORE_HOST_ENV, raising=False)
    assert network_mode() == "loopback"
    monkeypatch.setenv(STORE_HOST_ENV, "k1x0h1 198.18.0.1")
    assert network_mode() == "hosts"


@pytest.mark.parametrize("module", ["bench.flight_throughput"])
def test_hosts_flag_is_parsed_and_refused_with_the_reason(module: str, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    def unavailable(*, probe: bool = False) -> None:
        raise HostsUnavailableError("making network namespaces needs root (test)")

    monkeypatch.setattr(bench._hosts, "check_available", unavailable)
    main = __import__(module, fromlist=["main"]).main
    out = tmp_path / "r.json"
    assert main(["--quick", "--hosts", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--hosts" in err and "needs root (test)" in err
    assert not out.exists()


@pytest.mark.hosts
@pytest.mark.slow
def test_flight_throughput_across_hosts(tmp_path: Path) -> None:
    """The quick run with its store in one host and the benchmark in another; the bytes crossed the link."""
    out = tmp_path / "ft.json"
    subprocess.run([sys.executable, "-m", "bench.flight_throughput", "--quick", "--hosts", "--out", str(out)],
                   cwd=ROOT, check=True, timeout=120, capture_output=True)
    doc = json.loads(out.read_text())
    hosts = doc["params"]["hosts"]
    assert doc["params"]["network"] == "hosts"
    assert hosts["store_host"].startswith("198.1") and hosts["client_host"] != hosts["store_host"]
    assert hosts["store_link_tx_bytes"] > doc["metrics"]["doget_bytes"]  # served to the client over the veth
    assert doc["metrics"]["doget_gbps"] > 0
