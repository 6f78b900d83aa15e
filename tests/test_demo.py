"""``knit run`` (the interim main job) and the ``knit`` command's dispatch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from flight_store import cli
from flight_store.demo import main as demo_main


def test_demo_runs_and_reports(capsys) -> None:
    assert demo_main(["--groups", "9", "--group-size", "3"]) == 0
    out = capsys.readouterr().out
    assert "2 store nodes, 27 trajectories in 9 groups" in out
    assert "fetched micro-batch: 6 rows" in out and "released 2 groups" in out
    for source in ("math", "code", "chat"):
        assert source in out


def test_knit_run_dispatches_lazily(capsys, monkeypatch) -> None:
    monkeypatch.setitem(cli.LAZY_COMMANDS, "echo", ("tests.test_demo:_echo", "test command"))
    monkeypatch.setitem(cli.LAZY_COMMANDS, "echo2", "tests.test_demo:_echo")  # plain string form
    assert cli.main(["echo", "a", "--b"]) == 3
    assert capsys.readouterr().out.strip() == "['a', '--b']"
    assert cli.main(["echo2"]) == 3
    assert cli.main(["demo", "--groups", "3"]) == 0


def _echo(argv: list[str]) -> int:
    print(argv)
    return 3


def test_knit_help_lists_commands(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "serve" in out and "run" in out


def test_flight_store_imports_no_heavy_package() -> None:
    code = (
        "import sys, flight_store, flight_store.cli, flight_store.demo; "
        "heavy = {'torch', 'admission', 'train', 'connectors', 'vllm', 'megatron'}; "
        "bad = heavy & {m.split('.')[0] for m in sys.modules}; "
        "print(sorted(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"
