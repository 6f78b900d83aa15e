"""bench.streams at the smallest size: held calls are counted on the node, and honest calls still get through."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import streams


def test_held_read_channels_each_hold_a_node_thread_and_honest_calls_still_pass(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(streams, "KINDS", ("read_channel",))
    monkeypatch.setattr(streams, "QUICK_STEPS", (5, 20))
    out = tmp_path / "streams.json"
    assert streams.main(["--quick", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    run = doc["raw"]["read_channel"]
    assert [s["held"] for s in run["steps"]] == [5, 20]
    assert run["steps"][-1]["threads"] - run["base"]["threads"] >= 20  # every held channel holds a thread
    assert all(s["honest"]["read_rows"] == 8 for s in run["steps"])
    assert doc["metrics"]["streams_read_channel_held_max"] == 20
    assert doc["params"]["refused"] == {"read_channel": None}
