"""A vLLM server as the rollout's engine: token ids in, token ids and their logprobs out, over HTTP.

:class:`ServedEngine` is a ``connectors.engine.RolloutEngine`` (and a ``connectors.agent.TurnEngine``) over a
running vLLM OpenAI-compatible server, as verl's agent loop, slime, AReaL and SkyRL drive their engines:

* **Requests.** Each prompt group is one ``POST /v1/completions`` whose ``prompt`` is the prompt's token ids (the
  chat template applied here, with the model folder's own tokenizer, as the in-process engine does), ``n`` = G,
  ``logprobs: 0`` (the sampled token's logprob at each position) and ``return_token_ids`` (each sample's token ids,
  so nothing is re-tokenized). Requests go out from an asyncio client on a thread of its own, at most
  ``max_inflight`` at once (the rollout's ``prompts_per_wave`` bounds the groups in flight already); the request
  id is the group id, so ``abort`` can name it.
* **Weights.** The server pulls a published version from the store nodes itself, through knittrans'
  weight-transfer engine (:mod:`connectors.vllm_transfer`, registered in every ``vllm serve`` by this
  distribution's ``vllm.general_plugins`` entry point). :meth:`ServedEngine.load_version` drives vLLM's RL API:
  ``/pause`` (``mode=keep``: running requests freeze and go on afterwards), ``/init_weight_transfer_engine`` (once),
  ``/start_weight_update``, ``/update_weights`` with the version, ``/finish_weight_update``, ``/resume``. Only the
  version number crosses HTTP. An update that fails leaves the server on the weights it had, and raises
  :class:`EngineServerError`.
* **Aborts.** :meth:`ServedEngine.abort` cancels the requests here and asks the server to drop them
  (``/abort_requests``).
* **Faults.** A server that cannot be reached, does not answer within ``request_timeout_s``, answers with an HTTP
  error or with JSON that is not a completion, or returns token ids outside the model's vocabulary does not
  stop the rollout: the group comes back with every sample finished ``engine_error`` (written "aborted", its
  prompt dispatched again as any aborted group's is) and the reason is logged with the URL.

:func:`server_command` is the ``vllm serve`` the launcher starts for ``knit run --engine vllm-server``; a server
the user runs (``--engine-url``) must be started with ``VLLM_SERVER_DEV_MODE=1`` (vLLM's RL API) and
``--weight-transfer-config '{"backend": "knittrans"}'`` to take weights, and with the run's logprob mode.

Needs ``aiohttp`` and ``transformers`` (the ``vllm`` extra); vLLM itself is not imported in this process.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from connectors.config import RolloutConfig
from connectors.partial import ResumedCompletion, SampledLogprobs
from connectors.tasks import Prompt, chat_prompt_ids
from connectors.vllm_plugin import BACKEND
from flight_store.secrets import read_token_file

logger = logging.getLogger(__name__)

SERVER_ENV = {"VLLM_SERVER_DEV_MODE": "1"}
"""Environment a served engine needs on top of the rollout's: vLLM's RL API (pause, abort, weight transfer)."""
ENGINE_ERROR = "engine_error"
"""``finish_reason`` of every sample of a group the server failed (the group is written "aborted")."""


class EngineServerError(RuntimeError):
    """The engine's server could not do what was asked: the message names its URL and what was wrong."""


@dataclass(frozen=True, slots=True)
class ServedOutput:
    """One prompt's samples as the server returned them (a ``connectors.vllm.FinishedRequest``)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[ResumedCompletion]


def server_command(config: RolloutConfig, port: int, host: str = "127.0.0.1") -> list[str]:
    """The ``vllm serve`` of ``config.model`` with the settings the in-process engine uses, vLLM's RL API on and
    knittrans' weight transfer (run it with :data:`SERVER_ENV`)."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", config.model,
           "--host", host, "--port", str(port), "--dtype", config.dtype, "--max-model-len", str(config.max_model_len),
           "--max-num-seqs", str(config.max_num_seqs), "--seed", str(config.seed),
           "--logprobs-mode", config.logprobs_mode, "--tensor-parallel-size", str(config.tensor_parallel_size),
           "--weight-transfer-config", json.dumps({"backend": BACKEND}), "--disable-uvicorn-access-log"]
    if config.tensor_parallel_size == 1:  # the worker inside the engine core's process: one process fewer to start
        cmd += ["--distributed-executor-backend", "uni"]
    return [*cmd, "--enforce-eager"] if config.enforce_eager else cmd


class ServedEngine:
    """A vLLM server driven token in, token out (module docstring).

    Args:
        config: the rollout config (the model folder for the tokenizer, sampling settings, the stores and their
            token for the weight transfer).
        url: the server, ``http://HOST:PORT``.
        start_timeout_s: how long to wait for the server to answer ``/health`` (it may still be starting).
        request_timeout_s: one request's deadline (a group that takes longer is failed ``engine_error``).
        max_inflight: most requests outstanding at once.
    """

    def __init__(self, config: RolloutConfig, url: str, *, start_timeout_s: float = 600.0,
                 request_timeout_s: float = 600.0, max_inflight: int = 256) -> None:
        import aiohttp
        from transformers import AutoTokenizer

        self.url = url.rstrip("/")
        self.config = config
        self.logprobs_mode: str = config.logprobs_mode
        self._aiohttp = aiohttp
        self._tokenizer = AutoTokenizer.from_pretrained(config.model)
        self._use_chat = bool(config.chat_template and getattr(self._tokenizer, "chat_template", None))
        self._vocab = _vocab_size(config.model, len(self._tokenizer))
        self._timeout = request_timeout_s
        self._done: queue.SimpleQueue[ServedOutput] = queue.SimpleQueue()
        self._running: dict[str, Future[None]] = {}
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="served-engine", daemon=True)
        self._thread.start()
        self._limit = asyncio.Semaphore(max_inflight)
        self._session: Any = self._run(self._open(), timeout=30.0)
        self._transfer_ready = False
        try:
            self._wait_ready(start_timeout_s)
            self.model_name = self._model_name()
        except BaseException:
            self.close()
            raise

    # ---- requests ------------------------------------------------------------------------------

    def submit(self, request_id: str, prompt: Prompt, n: int) -> None:
        if prompt.images:
            msg = f"the served engine at {self.url} takes text prompts only; group {request_id} has images"
            raise ValueError(msg)
        ids = self.prompt_ids(prompt.text)
        if len(ids) >= self.config.max_model_len:
            msg = f"prompt of {len(ids)} tokens does not fit max_model_len {self.config.max_model_len}"
            raise ValueError(msg)
        self._send(request_id, ids, n, self.config.max_tokens, ())

    def submit_tokens(self, request_id: str, token_ids: Sequence[int], max_tokens: int, stop: Sequence[str]) -> None:
        """One agent turn: continue ``token_ids`` (``connectors.agent.TurnEngine``)."""
        if len(token_ids) + 1 > self.config.max_model_len:
            msg = f"context of {len(token_ids)} tokens does not fit max_model_len {self.config.max_model_len}"
            raise ValueError(msg)
        self._send(request_id, [int(t) for t in token_ids], 1, max_tokens, stop)

    def prompt_ids(self, text: str) -> list[int]:
        """The token ids a text prompt goes in as (in the chat template when the tokenizer has one)."""
        if self._use_chat:
            return chat_prompt_ids(self._tokenizer, text)
        return [int(t) for t in self._tokenizer.encode(text)]

    def encode(self, text: str) -> list[int]:
        """The token ids of ``text`` on its own, no special tokens added (an agent's observation)."""
        return [int(t) for t in self._tokenizer.encode(text, add_special_tokens=False)]

    def step(self) -> list[ServedOutput]:
        """The groups finished since the last call; waits up to 50 ms for one when requests are running."""
        out: list[ServedOutput] = []
        with self._lock:
            busy = bool(self._running)
        try:
            out.append(self._done.get(timeout=0.05) if busy else self._done.get_nowait())
        except queue.Empty:
            return out
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    def abort(self, request_ids: Sequence[str]) -> None:
        with self._lock:
            futures = [self._running.pop(r, None) for r in request_ids]
        for fut in futures:
            if fut is not None:
                fut.cancel()
        if request_ids:
            try:
                self._post("/abort_requests", {"request_ids": [f"cmpl-{r}" for r in request_ids]}, timeout=30.0)
            except EngineServerError as exc:  # cancelled here already: the server ends them when it notices
                logger.warning("%s", exc)

    def _send(self, request_id: str, ids: list[int], n: int, max_tokens: int, stop: Sequence[str]) -> None:
        body: dict[str, Any] = {
            "model": self.model_name, "prompt": ids, "n": n, "max_tokens": max_tokens,
            "temperature": self.config.temperature, "top_p": self.config.top_p, "logprobs": 0,
            "return_token_ids": True, "ignore_eos": self.config.ignore_eos, "request_id": request_id,
            "skip_special_tokens": True,
        }
        if stop:
            body.update(stop=list(stop), include_stop_str_in_output=True)
        with self._lock:  # registered before the request can finish (it takes the lock to hand its output over)
            self._running[request_id] = asyncio.run_coroutine_threadsafe(self._request(request_id, ids, n, body),
                                                                         self._loop)

    async def _request(self, request_id: str, ids: list[int], n: int, body: dict[str, Any]) -> None:
        async with self._limit:
            try:
                timeout = self._aiohttp.ClientTimeout(total=self._timeout)
                async with self._session.post(f"{self.url}/v1/completions", json=body, timeout=timeout) as resp:
                    text = await resp.text()
                    if resp.status != 200:
                        raise EngineServerError(f"HTTP {resp.status}: {text[:300]}")
                out = self._parse(request_id, ids, n, text)
            except asyncio.CancelledError:
                raise
            except (EngineServerError, TimeoutError, self._aiohttp.ClientError, OSError) as exc:
                what = f"no answer within {self._timeout} s" if isinstance(exc, TimeoutError) else str(exc)
                logger.warning("engine server %s failed group %s: %s", self.url, request_id, what)
                out = self._failed(request_id, ids, n)
        with self._lock:
            if self._running.pop(request_id, None) is None:  # aborted meanwhile: nobody waits for it
                return
        self._done.put(out)

    def _parse(self, request_id: str, ids: list[int], n: int, text: str) -> ServedOutput:
        """The completion response ``text`` as one output; :class:`EngineServerError` naming what is wrong."""
        try:
            doc = json.loads(text)
            choices = doc["choices"]
            outputs = []
            for c in choices:
                tokens = [int(t) for t in c["token_ids"]]
                lps = [float(x) for x in c["logprobs"]["token_logprobs"]]
                outputs.append(ResumedCompletion(index=int(c["index"]), token_ids=tokens,
                                                 logprobs=SampledLogprobs(tokens, lps),
                                                 finish_reason=c.get("finish_reason"), text=str(c.get("text", ""))))
        except (ValueError, KeyError, TypeError) as exc:
            what = f"{type(exc).__name__}: {exc}"
            raise EngineServerError(f"malformed completion JSON ({what}): {text[:200]!r}") from None
        if len(outputs) != n:
            raise EngineServerError(f"{len(outputs)} samples for n={n}")
        for c in outputs:
            if len(c.logprobs.logprobs) != len(c.token_ids):
                raise EngineServerError(f"{len(c.logprobs.logprobs)} logprobs for {len(c.token_ids)} tokens")
            bad = [t for t in c.token_ids if not 0 <= t < self._vocab]
            if bad:
                raise EngineServerError(f"token id {bad[0]} outside the vocabulary [0, {self._vocab})")
        return ServedOutput(request_id=request_id, prompt_token_ids=ids, outputs=outputs)

    @staticmethod
    def _failed(request_id: str, ids: list[int], n: int) -> ServedOutput:
        return ServedOutput(request_id=request_id, prompt_token_ids=ids, outputs=[
            ResumedCompletion(index=i, token_ids=[], logprobs=SampledLogprobs([], []), finish_reason=ENGINE_ERROR,
                              text="") for i in range(n)])

    # ---- weights -------------------------------------------------------------------------------

    def load_weights(self, table: Any, version: int | None = None) -> None:
        """Not how a served engine takes weights: it pulls a version itself (:meth:`load_version`)."""
        msg = f"the served engine at {self.url} pulls published versions itself: call load_version"
        raise NotImplementedError(msg)

    def load_version(self, version: int) -> float:
        """Have the server load published ``version`` from the stores (vLLM's RL API); returns the seconds it took.

        Raises:
            EngineServerError: a call failed (the server stays on the weights it had).
        """
        t0 = time.perf_counter()
        if not self._transfer_ready:
            self._post("/init_weight_transfer_engine", {"init_info": transfer_init_info(self.config)})
            self._transfer_ready = True
        self._post("/pause?mode=keep", None)
        try:
            self._post("/start_weight_update", None)
            self._post("/update_weights", {"update_info": {"version": int(version)}})
            self._post("/finish_weight_update", {"weight_version": str(version)})
        finally:
            self._post("/resume", None)
        return time.perf_counter() - t0

    def weight_version(self) -> str | None:
        """The version the server says it runs (``/weight_info``)."""
        return self._get("/weight_info").get("weight_version")

    # ---- plumbing ------------------------------------------------------------------------------

    async def _open(self) -> Any:
        return self._aiohttp.ClientSession()

    def _run(self, coro: Any, timeout: float) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _call(self, method: str, path: str, body: Any, timeout: float) -> Any:
        async with self._session.request(method, f"{self.url}{path}", json=body,
                                         timeout=self._aiohttp.ClientTimeout(total=timeout)) as resp:
            text = await resp.text()
            if resp.status != 200:
                raise EngineServerError(f"{method} {self.url}{path}: HTTP {resp.status}: {text[:300]}")
            try:
                return json.loads(text)
            except ValueError:
                raise EngineServerError(f"{method} {self.url}{path}: not JSON: {text[:200]!r}") from None

    def _http(self, method: str, path: str, body: Any, timeout: float) -> Any:
        """One control call; once more on a connection the server closed (it closes one after answering an error,
        so the next call on it from the pool finds it reset)."""
        aio = self._aiohttp
        for attempt in (0, 1):
            try:
                return self._run(self._call(method, path, body, timeout), timeout + 5.0)
            except EngineServerError:
                raise
            except (TimeoutError, aio.ClientError, OSError) as exc:
                late = isinstance(exc, TimeoutError)
                if attempt == 0 and isinstance(exc, aio.ClientConnectionError) and not (
                        late or isinstance(exc, aio.ClientConnectorError)):
                    continue  # a pooled connection the server had closed
                what = f"no answer within {timeout} s" if late else f"{type(exc).__name__}: {exc}"
                raise EngineServerError(f"{method} {self.url}{path}: {what}") from None
        raise AssertionError("unreachable")

    def _post(self, path: str, body: Any, timeout: float = 300.0) -> Any:
        return self._http("POST", path, body, timeout)

    def _get(self, path: str, timeout: float = 30.0) -> Any:
        return self._http("GET", path, None, timeout)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self._run(self._health(), timeout=10.0)
                return
            except Exception as exc:
                if time.monotonic() >= deadline:
                    msg = f"the engine server at {self.url} did not answer /health within {timeout_s} s: {exc}"
                    raise EngineServerError(msg) from None
                time.sleep(0.5)

    async def _health(self) -> None:
        async with self._session.get(f"{self.url}/health", timeout=self._aiohttp.ClientTimeout(total=5.0)) as resp:
            if resp.status != 200:
                raise EngineServerError(f"/health answered HTTP {resp.status}")

    def _model_name(self) -> str:
        models = self._get("/v1/models").get("data") or []
        if not models:
            msg = f"the engine server at {self.url} serves no model (/v1/models is empty)"
            raise EngineServerError(msg)
        return str(models[0]["id"])

    def close(self) -> None:
        """Cancel what is running and close the client (the server keeps running)."""
        with self._lock:
            futures, self._running = list(self._running.values()), {}
        for fut in futures:
            fut.cancel()
        if self._loop.is_running():
            try:
                self._run(self._session.close(), timeout=10.0)
            except Exception as exc:  # closing after a failure: nothing more to do
                logger.debug("closing the client session: %s", exc)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10.0)
        if not self._loop.is_running() and not self._loop.is_closed():
            self._loop.close()


def transfer_init_info(config: RolloutConfig) -> dict[str, Any]:
    """``init_info`` of ``/init_weight_transfer_engine`` (``connectors.vllm_transfer.FlightInit``): the rollout's
    stores, and its credentials read from their files (the server may run where the files are not)."""
    c = config.client
    return {"stores": list(config.stores),
            "token": read_token_file(c.token_file) if c.token_file else None,
            "tls_root_certs": Path(c.tls_root_certs_file).read_text() if c.tls_root_certs_file else None,
            "timeout_s": float(c.timeout_s or 60.0)}


def _vocab_size(model_dir: str, tokenizer_len: int) -> int:
    """The model's vocabulary size (its ``config.json``; the tokenizer's length when that has none)."""
    try:
        return max(int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]), tokenizer_len)
    except (OSError, ValueError, KeyError):
        return tokenizer_len
