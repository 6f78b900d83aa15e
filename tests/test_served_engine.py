"""The served engine (``connectors.served``) against a scripted HTTP server that answers as vLLM's does, or fails
as a server can: every fault comes back as an ``engine_error`` group naming the URL, the rollout writes it
"aborted" and sends its prompt out again, a failed weight update keeps the version the engine had, and aborts
reach the server. The real server is driven in ``tests/test_weight_sync.py``."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from connectors.config import RolloutConfig
from connectors.rollout import RolloutWorker
from connectors.served import ENGINE_ERROR, EngineServerError, ServedEngine
from connectors.tasks import Prompt
from connectors.weight_sync import WeightSync
from flight_store.net import free_port
from flight_store.reading import StoreReader
from flight_store.writing import StoreWriter

VOCAB = 512


class Script:
    """What the scripted server does: per request id prefix, a fault or a good answer; every call it saw."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.fail_first = 0  # the first this many completions answer malformed JSON, whatever their id
        self.completions = 0
        self.lock = threading.Lock()

    def completion(self, body: dict[str, Any]) -> tuple[int, str]:
        rid = str(body["request_id"])
        with self.lock:
            self.completions += 1
            failing = self.completions <= self.fail_first
        if failing or rid.startswith("malformed"):
            return 200, '{"choices": [{"index": 0, "token_ids": [1, 2'
        if rid.startswith("http500"):
            return 500, '{"error": "engine core died"}'
        if rid.startswith("hang"):
            time.sleep(3.0)
        ids = [VOCAB + 7] if rid.startswith("vocab") else [17, 18, 19]
        text = "12"
        if "#" in rid:  # an agent's turn (group#episode.turn): a calculator call first, then the answer
            text = "<calc>3*4</calc>" if rid.endswith(".0") else "Answer: 12"
        choices = [{"index": i, "text": text, "token_ids": ids, "finish_reason": "stop",
                    "logprobs": {"token_logprobs": [-0.5] * len(ids)}} for i in range(int(body["n"]))]
        return 200, json.dumps({"id": f"cmpl-{rid}", "choices": choices})


def _handler(script: Script) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _answer(self, status: int, text: str) -> None:
            data = text.encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            with contextlib.suppress(OSError):  # the client gave up (a request aborted or timed out)
                self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._answer(200, "{}")
            elif self.path == "/v1/models":
                self._answer(200, json.dumps({"data": [{"id": "tiny"}]}))
            else:
                self._answer(404, "{}")

        def do_POST(self) -> None:
            size = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(size) if size else b""
            body = json.loads(raw) if raw else None
            script.calls.append((self.path, body))
            if self.path == "/v1/completions":
                self._answer(*script.completion(body))
            elif self.path == "/update_weights" and body["update_info"]["version"] == 99:
                self._answer(500, '{"error": "UnknownWeightsError: no weights of version 99"}')
            else:
                self._answer(200, '{"message": "ok"}')

    return Handler


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from connectors.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama", layers=1, hidden=32, heads=2, kv_heads=1,
                            vocab=VOCAB)


@pytest.fixture
def server() -> Iterator[tuple[str, Script]]:
    script = Script()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(script))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", script
    httpd.shutdown()
    httpd.server_close()


def _config(model: Path, stores: list[str] | None = None, **kw: Any) -> RolloutConfig:
    return RolloutConfig(model=str(model), stores=stores or ["grpc://127.0.0.1:1"], engine="vllm-server",
                         engine_url="http://127.0.0.1:1", **kw)


def _drain(engine: ServedEngine, n: int, timeout_s: float = 20.0) -> dict[str, Any]:
    got: dict[str, Any] = {}
    deadline = time.monotonic() + timeout_s
    while len(got) < n and time.monotonic() < deadline:
        got.update({o.request_id: o for o in engine.step()})
    return got


def test_every_fault_comes_back_as_an_engine_error_group_naming_the_url(  # type: ignore[no-untyped-def]
        server, tiny_model: Path, caplog) -> None:
    url, _ = server
    engine = ServedEngine(_config(tiny_model), url, request_timeout_s=1.0)
    try:
        for rid in ("good-1", "malformed-1", "vocab-1", "http500-1", "hang-1"):
            engine.submit(rid, Prompt(data_source="add_small", text="What is 3 + 4?", sample={"answer": "7"}), 2)
        with caplog.at_level(logging.WARNING, logger="connectors.served"):
            got = _drain(engine, 5)
    finally:
        engine.close()
    assert sorted(got) == ["good-1", "hang-1", "http500-1", "malformed-1", "vocab-1"]
    good = got["good-1"]
    assert [c.token_ids for c in good.outputs] == [[17, 18, 19]] * 2
    assert [c.finish_reason for c in good.outputs] == ["stop"] * 2
    assert good.prompt_token_ids == engine.prompt_ids("What is 3 + 4?")
    for rid in ("malformed-1", "vocab-1", "http500-1", "hang-1"):
        assert [(c.finish_reason, c.token_ids) for c in got[rid].outputs] == [(ENGINE_ERROR, [])] * 2
    text = "\n".join(r.getMessage() for r in caplog.records)
    for what in ("malformed completion JSON", f"token id {VOCAB + 7} outside the vocabulary [0, {VOCAB})",
                 "HTTP 500", "no answer within 1.0 s"):
        assert what in text
    assert text.count(url) >= 4


def test_a_server_that_never_answers_is_refused_naming_its_url(tiny_model: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(EngineServerError, match=f"engine server at {url} did not answer /health within 1.0 s"):
        ServedEngine(_config(tiny_model), url, start_timeout_s=1.0)


def test_weights_go_through_the_rl_api_and_a_failed_update_keeps_the_version(  # type: ignore[no-untyped-def]
        server, tiny_model: Path) -> None:
    url, script = server

    class Published:  # the stores' published version, as WeightSync asks it
        version = 3

        def get_version(self) -> int:
            return self.version

    engine = ServedEngine(_config(tiny_model, stores=["grpc://127.0.0.1:7"]), url)
    stores = Published()
    try:
        sync = WeightSync(stores, engine, version=0, poll_s=0.0, load=True)  # type: ignore[arg-type]
        sync.poll(force=True)
        assert sync.version == 3 and sync.failed_loads == 0
        rl = [(p, b) for p, b in script.calls if p != "/v1/completions"]
        assert [p for p, _ in rl] == ["/init_weight_transfer_engine", "/pause?mode=keep", "/start_weight_update",
                                      "/update_weights", "/finish_weight_update", "/resume"]
        assert rl[0][1]["init_info"]["stores"] == ["grpc://127.0.0.1:7"]
        assert rl[3][1] == {"update_info": {"version": 3}} and rl[4][1] == {"weight_version": "3"}
        script.calls.clear()
        stores.version = 99  # published, but the server fails to load it
        sync.poll(force=True)
        assert sync.version == 3 and sync.failed_loads == 1  # the engine stays on the version it runs
        assert [p for p, _ in script.calls] == ["/pause?mode=keep", "/start_weight_update", "/update_weights",
                                                "/resume"]  # no second init; resumed after the failure
        with pytest.raises(EngineServerError, match=f"POST {url}/update_weights: HTTP 500: .*no weights of version 99"):
            engine.load_version(99)
    finally:
        engine.close()


def test_abort_drops_the_request_here_and_at_the_server(server, tiny_model: Path) -> None:  # type: ignore[no-untyped-def]
    url, script = server
    engine = ServedEngine(_config(tiny_model), url)
    try:
        engine.submit("hang-2", Prompt(data_source="add_small", text="What is 1 + 1?", sample={"answer": "2"}), 4)
        engine.submit("good-2", Prompt(data_source="add_small", text="What is 1 + 2?", sample={"answer": "3"}), 4)
        engine.abort(["hang-2"])
        got = _drain(engine, 2, timeout_s=5.0)
    finally:
        engine.close()
    assert list(got) == ["good-2"]  # nothing comes back for the aborted group
    assert ("/abort_requests", {"request_ids": ["cmpl-hang-2"]}) in script.calls


def _rollout(model: Path, nodes: list[str], url: str, **kw: Any) -> tuple[Any, pl.DataFrame]:
    """A rollout worker of groups of 2 on the served engine at ``url``, run to its end: its report, the stored
    metadata."""
    cfg = RolloutConfig(model=str(model), stores=nodes, engine="vllm-server", engine_url=url, group_size=2,
                        weight_sync=False, **kw)
    with StoreReader(nodes) as client, StoreWriter.sharing(client) as writer:
        with RolloutWorker(cfg, client=writer) as worker:
            report = worker.run()
        return report, client.scan_metadata()


def test_the_rollout_writes_failed_groups_aborted_and_sends_their_prompts_again(  # type: ignore[no-untyped-def]
        server, tiny_model: Path, store_nodes) -> None:
    url, script = server
    script.fail_first = 3
    report, frame = _rollout(tiny_model, [s.location for s in store_nodes(1)], url, max_groups=6, prompts_per_wave=2,
                             data_sources={"add_small": 1.0})
    assert report.engine == "vllm-server"
    assert report.aborted_groups == 3 and len(report.redispatched) == 3
    aborted = frame.filter(pl.col("status") == "aborted")
    assert aborted["group_id"].n_unique() == 3 and set(aborted["finish_reason"]) == {ENGINE_ERROR}
    completed = frame.filter(pl.col("status") == "completed")
    assert completed["group_id"].n_unique() == 6  # every prompt came through: the failed ones sent again
    assert set(report.redispatched.values()) <= set(aborted["group_id"])


def test_every_vllm_serve_finds_the_transfer_engine_through_the_entry_point() -> None:
    from importlib.metadata import entry_points

    from connectors.vllm_plugin import register

    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "knittrans"]
    assert ep.value == "connectors.vllm_plugin:register" and ep.load() is register


def test_agent_turns_go_to_the_server_token_in_token_out(server, tiny_model: Path, store_nodes) -> None:  # type: ignore[no-untyped-def]
    """A calculator group on the served engine: each turn is a request of the context's token ids with the
    environment's stop string; the rows hold both model turns and the tool's answer, masked out."""
    url, script = server
    report, frame = _rollout(tiny_model, [s.location for s in store_nodes(1)], url, max_groups=1, prompts_per_wave=1,
                             data_sources={"calculator": 1.0})
    assert report.tool_call_rate == {"calculator": 1.0} and report.aborted_groups == 0
    assert frame["num_turns"].to_list() == [2, 2]
    assert (frame["loss_tokens"] == 6).all() and (frame["response_len"] > 6).all()  # 2 turns of 3 + the tool's
    turns = [b for p, b in script.calls if p == "/v1/completions"]
    assert len(turns) == 4 and all(b["stop"] == ["</calc>"] and b["include_stop_str_in_output"] for b in turns)
    first, second = sorted((b for b in turns if b["request_id"].endswith("#0.0") or b["request_id"].endswith("#0.1")),
                           key=lambda b: b["request_id"])
    assert second["prompt"][:len(first["prompt"])] == first["prompt"]  # the context grows by tokens ...
    assert second["prompt"][len(first["prompt"]):len(first["prompt"]) + 3] == [17, 18, 19]  # ... the turn's own

