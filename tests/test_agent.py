"""The agent loop (connectors.agent) and the calculator tool (connectors.calculator), with the scripted turn engine.

The calculator: its arithmetic, and every expression it refuses answered as an error observation. The loop: the
context of each turn is the prompt's ids, then the sampled turns and observations as tokens, exactly; the mask,
the logprobs and ``num_turns`` of the written rows; the turn and token limits; a mix of tool and single-turn
sources through one engine; and a rollout of the calculator source into a store, read back.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from connectors.agent import AgentEngine, AgentGroupOutput, AgentLimits, with_agents
from connectors.calculator import MAX_DEPTH, MAX_EXPRESSION_CHARS, CalcError, CalculatorEnv, evaluate
from connectors.config import RolloutConfig
from connectors.fake_engine import FakeTurnEngine
from connectors.rollout import RolloutWorker
from connectors.tasks import ARITHMETIC_TASKS, TOOL_TASKS, Prompt, mixed_prompts
from connectors.vllm import group_to_batch
from flight_store.reading import StoreReader
from flight_store.writing import StoreWriter
from schemas.plan import PlannedSlice
from schemas.trajectory import normalize_group

ROOT = Path(__file__).resolve().parents[1]

# ---- the calculator ------------------------------------------------------------------------------


@pytest.mark.parametrize(("expression", "value"), [
    ("12*34", "408"), ("2+3*4", "14"), ("(2+3)*4", "20"), ("10-4-3", "3"), ("-(3-5)", "2"), ("- -4", "4"),
    ("7/2", "3.5"), ("8/4", "2"), ("1/3", "0.333333"), (" 61 * 19 + 40 ", "1199"), ("100/7*7", "100"),
])
def test_the_calculator_computes_integer_arithmetic_exactly(expression: str, value: str) -> None:
    assert evaluate(expression) == value


@pytest.mark.parametrize(("expression", "reason"), [
    ("1/0", "division by zero"), ("2**3", "expected a number"), ("__import__('os')", "unexpected '_'"),
    ("1+", "ends too early"), ("(1+2", "without its"), ("1 2", "after a complete expression"), ("", "empty"),
    ("3.5*2", "unexpected '.'"), ("x", "unexpected 'x'"), ("9" * 31, "31 digits"),
    ("1" + "+1" * MAX_EXPRESSION_CHARS, "characters"), ("(" * (MAX_DEPTH + 1) + "1" + ")" * (MAX_DEPTH + 1), "nested"),
    ("999999999999999*999999999999999*99999", "more than 30 digits"),
])
def test_the_calculator_refuses_what_is_not_integer_arithmetic_naming_why(expression: str, reason: str) -> None:
    with pytest.raises(CalcError, match=reason.replace("(", r"\(").replace("*", r"\*")):
        evaluate(expression)


def test_the_environment_answers_calls_reports_errors_and_scores_the_final_turn() -> None:
    env = CalculatorEnv()
    prompt = TOOL_TASKS["calculator"].make(random.Random(0))
    assert env.reset(prompt) == prompt.text and prompt.sample["environment"] == "calculator"
    answer = prompt.sample["answer"]
    step = env.step("Let me compute. <calc>12*34</calc>")
    assert step == ("<result>408</result>", 0.0, False)
    step = env.step("<calc>5/(2-2)</calc>")
    assert step.observation == "<result>error: division by zero</result>" and not step.done
    assert env.step(f"Answer: {answer}") == ("", 1.0, True)
    assert env.step(f"Answer: {int(answer) + 1}") == ("", 0.0, True)
    assert env.calls == 2


# ---- the loop, scripted --------------------------------------------------------------------------

CALL, RESULT = "I will use the tool. <calc>12*34</calc>", "<result>408</result>"


def _run(engine: AgentEngine, prompt: Prompt, n: int = 2, max_steps: int = 50) -> AgentGroupOutput:
    engine.submit("g0", prompt, n)
    for _ in range(max_steps):
        done = engine.step()
        if done:
            (out,) = done
            assert isinstance(out, AgentGroupOutput)
            return out
    raise AssertionError("the group never finished")


def test_each_turn_continues_the_exact_tokens_and_the_rows_carry_mask_turns_and_reward() -> None:
    prompt = TOOL_TASKS["calculator"].make(random.Random(1))
    fake = FakeTurnEngine([CALL + " and text after the stop", f"So the answer is {prompt.sample['answer']}."])
    out = _run(AgentEngine(fake, AgentLimits(max_turns=4, max_total_tokens=200, max_turn_tokens=64)), prompt)
    first = fake.prompt_ids(prompt.text)
    turn0, obs = list(CALL.encode()), list(RESULT.encode())  # the turn is cut after its stop string
    turn1 = list(f"So the answer is {prompt.sample['answer']}.".encode())
    by_turn = {rid: ids for rid, ids, _, _ in fake.turn_requests}
    assert by_turn["g0#0.0"] == first
    assert by_turn["g0#0.1"] == first + turn0 + obs  # the sampled ids, then the observation's own tokens
    assert fake.turn_requests[0][3] == ("</calc>",) and fake.turn_requests[0][2] == 64
    assert out.prompt_token_ids == first and out.rewards == [1.0, 1.0]
    for c in out.outputs:
        assert c.token_ids == turn0 + obs + turn1
        assert c.loss_mask == [1] * len(turn0) + [0] * len(obs) + [1] * len(turn1)
        assert c.num_turns == 2 and c.tool_calls == 1 and c.finish_reason == "stop"
        assert c.logprobs.logprobs[len(turn0):len(turn0) + len(obs)] == [0.0] * len(obs)
        assert all(lp < 0 for i, lp in enumerate(c.logprobs.logprobs) if c.loss_mask[i])
    batch = normalize_group([group_to_batch(out, group_id="g0", policy_version=0, data_source="calculator",
                                            rewards=out.rewards)], "g0", 2)[0]
    row = batch.to_pylist()[0]
    assert row["num_turns"] == 2 and row["loss_tokens"] == len(turn0) + len(turn1)
    assert row["response_len"] == len(turn0) + len(obs) + len(turn1) and row["loss_mask"] == out.outputs[0].loss_mask
    assert row["response_logprobs"][len(turn0)] == 0.0 and row["reward"] == 1.0


def test_max_turns_stops_an_episode_that_keeps_calling() -> None:
    prompt = TOOL_TASKS["calculator"].make(random.Random(2))
    fake = FakeTurnEngine(["<calc>1+1</calc>"])
    out = _run(AgentEngine(fake, AgentLimits(max_turns=3, max_total_tokens=500, max_turn_tokens=64)), prompt, n=1)
    (c,) = out.outputs
    assert c.num_turns == 3 and c.finish_reason == "length" and out.rewards == [0.0]
    assert c.tool_calls == 2  # the third turn's call is not answered: no turn may follow it
    assert len(fake.turn_requests) == 3 and c.loss_mask[-1] == 1


def test_max_total_tokens_bounds_the_response() -> None:
    prompt = TOOL_TASKS["calculator"].make(random.Random(3))
    fake = FakeTurnEngine(["<calc>1+1</calc>", "<calc>2+2</calc>", "a long final answer " * 10])
    limit = 60
    out = _run(AgentEngine(fake, AgentLimits(max_turns=8, max_total_tokens=limit, max_turn_tokens=64)), prompt, n=1)
    (c,) = out.outputs
    assert len(c.token_ids) <= limit and c.finish_reason == "length" and out.rewards == [0.0]
    # each turn asked for no more tokens than the room left
    for _, ids, max_tokens, _ in fake.turn_requests:
        assert len(ids) - len(fake.prompt_ids(prompt.text)) + max_tokens <= limit


def test_a_turn_the_engine_refuses_ends_the_episode_where_it_is() -> None:
    prompt = TOOL_TASKS["calculator"].make(random.Random(4))
    fake = FakeTurnEngine(["<calc>1+1</calc>"])
    fake.refuse = "<result>2</result>"  # the second turn's context holds the first observation
    out = _run(AgentEngine(fake, AgentLimits()), prompt, n=1)
    (c,) = out.outputs
    assert c.finish_reason == "length" and c.num_turns == 1 and c.tool_calls == 1


def test_single_turn_prompts_go_through_and_a_group_aborts_its_turns() -> None:
    fake = FakeTurnEngine(["<calc>1+1</calc>"])
    engine = AgentEngine(fake, AgentLimits())
    plain = ARITHMETIC_TASKS["add_small"].make(random.Random(0))
    engine.submit("s0", plain, 2)
    engine.submit("a0", TOOL_TASKS["calculator"].make(random.Random(0)), 2)
    assert "s0" in fake.running and {r for r, *_ in fake.turn_requests} == {"a0#0.0", "a0#1.0"}
    engine.abort(["a0", "s0"])
    assert set(fake.aborted) == {"a0#0.0", "a0#1.0", "s0"}
    assert engine.step() == []
    with pytest.raises(ValueError, match="environment 'nope'"):
        engine.submit("x", Prompt(data_source="t", text="q", sample={"environment": "nope"}), 1)


def test_a_rollout_with_a_tool_source_wraps_its_engine() -> None:
    base = {"model": "m", "stores": ["grpc://127.0.0.1:1"]}
    fake = FakeTurnEngine(["x"])
    assert with_agents(fake, RolloutConfig(**base)) is fake  # type: ignore[arg-type]
    wrapped = with_agents(fake, RolloutConfig(**base, data_sources={"calculator": 0.5, "add_small": 0.5},  # type: ignore[arg-type]
                                              agent_max_turns=2, agent_max_tokens=50, max_tokens=20))
    assert isinstance(wrapped, AgentEngine) and wrapped.limits == AgentLimits(2, 50, 20)
    stream = mixed_prompts({"calculator": 0.5, "add_small": 0.5}, chunk=2)
    sources = {next(stream).data_source for _ in range(4)}
    assert sources == {"calculator", "add_small"}
    with pytest.raises(ValueError, match="partial_rollouts does not run the tool sources"):
        RolloutConfig(**base, data_sources={"calculator": 1.0}, weight_sync=True, partial_rollouts=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="agent_max_turns=0"):
        RolloutConfig(**base, agent_max_turns=0)  # type: ignore[arg-type]


# ---- into a store --------------------------------------------------------------------------------


def _stored_rows(location: str) -> list[dict[str, Any]]:
    with StoreReader([location]) as client:
        meta = client.scan_metadata(columns=["group_id", "sample_idx"])
        groups = sorted(set(meta["group_id"].to_list()))
        slices = [PlannedSlice(node=location, group_id=g, start=0,
                               stop=int((meta["group_id"] == g).sum())) for g in groups]
        table = client.fetch(slices, columns=["group_id", "sample_idx", "data_source", "prompt_ids", "response_ids",
                                              "response_logprobs", "loss_mask", "num_turns", "loss_tokens", "reward",
                                              "status", "finish_reason"])
    return table.to_pylist()


def test_a_calculator_rollout_writes_multi_turn_rows_to_the_store(store_nodes) -> None:  # type: ignore[no-untyped-def]
    (server,) = store_nodes(1)
    cfg = RolloutConfig(model="unused", stores=[server.location], data_sources={"calculator": 0.5, "add_small": 0.5},
                        group_size=2, max_groups=4, mix_chunk=2, prompts_per_wave=2, version_poll_s=0.0,
                        group_id_prefix="c-", max_tokens=64)
    fake = FakeTurnEngine([CALL, "Answer: 408"])
    with StoreWriter.from_config(cfg.stores, cfg.client) as writer, RolloutWorker(cfg, client=writer,
                                                                                 engine=fake) as worker:
        report = worker.run()
    rows = _stored_rows(server.location)
    assert len(rows) == 8 and {r["status"] for r in rows} == {"completed"}
    tool = [r for r in rows if r["data_source"] == "calculator"]
    plain = [r for r in rows if r["data_source"] == "add_small"]
    assert len(tool) == len(plain) == 4
    obs = list(RESULT.encode())
    for r in tool:
        assert r["num_turns"] == 2 and r["loss_tokens"] == sum(r["loss_mask"]) == len(r["response_ids"]) - len(obs)
        assert r["response_ids"] == list(CALL.encode()) + obs + list(b"Answer: 408")
        assert r["prompt_ids"][0] == FakeTurnEngine.BOS
    for r in plain:
        assert r["num_turns"] == 1 and r["loss_mask"] == [1] * len(r["response_ids"])
    assert report.tool_call_rate == {"add_small": 0.0, "calculator": 1.0}
    assert report.turns_mean == {"add_small": 1.0, "calculator": 2.0}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from launcher.children import child_env

    out = tmp_path_factory.mktemp("tiny") / "llama"
    code = f"from connectors.tiny_model import build_tiny_llama; build_tiny_llama({str(out)!r}, hidden=128, seed=0)"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=child_env(), check=True, timeout=120,
                   capture_output=True)
    return out


@pytest.mark.vllm
@pytest.mark.slow
def test_real_vllm_runs_calculator_groups_token_in_token_out_into_a_store(store_nodes, tiny_model: Path,  # type: ignore[no-untyped-def]
                                                                          tmp_path: Path) -> None:
    """vLLM on the tiny model (this file run as a script): every episode's first turn is answered with a tool
    result (the random model never writes a call itself), so each row holds a model turn, the observation's tokens
    and a second model turn; read back from the store, each turn's request was exactly the tokens before it."""
    from launcher.children import child_env

    (server,) = store_nodes(1)
    out = tmp_path / "agent.json"
    res = subprocess.run([sys.executable, __file__, str(tiny_model), server.location, str(out)], cwd=ROOT,
                         env=child_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    doc = json.loads(out.read_text())
    rows, turns, obs = doc["rows"], doc["turns"], doc["observation"]
    assert len(rows) == 4 and {r["status"] for r in rows} == {"completed"} and obs
    for r in rows:
        prompt, response, mask = r["prompt_ids"], r["response_ids"], r["loss_mask"]
        first, second = turns[f"{r['group_id']}#{r['sample_idx']}.0"], turns[f"{r['group_id']}#{r['sample_idx']}.1"]
        assert first == prompt and second[:len(prompt)] == prompt
        k = len(second) - len(prompt)  # the first turn and the observation
        assert response[:k] == second[len(prompt):] and response[k - len(obs):k] == obs
        n0 = k - len(obs)
        assert mask == [1] * n0 + [0] * len(obs) + [1] * (len(response) - k)
        assert r["num_turns"] == 2 and r["loss_tokens"] == len(response) - len(obs)
        lps = r["response_logprobs"]
        assert lps[n0:k] == [0.0] * len(obs) and all(lp <= 0 for lp in lps)


def _vllm_driver(model: str, location: str, out: str) -> None:
    """Two calculator groups of 2 on vLLM into the store at ``location``; every turn request and the stored rows
    to ``out``."""
    from connectors import agent
    from connectors.calculator import EnvStep
    from connectors.engine import ENGINE_ENV, VllmEngine

    for k, v in ENGINE_ENV.items():
        os.environ.setdefault(k, v)

    class FirstTurnCalls(CalculatorEnv):
        """The calculator, with a call to ``12*34`` added to the model's first turn."""

        def step(self, turn: str) -> EnvStep:
            return super().step(turn + "<calc>12*34</calc>" if self.calls == 0 else turn)

    agent.ENVIRONMENTS["calculator"] = FirstTurnCalls
    cfg = RolloutConfig(model=model, stores=[location], data_sources={"calculator": 1.0}, group_size=2, max_groups=2,
                        prompts_per_wave=2, max_tokens=8, agent_max_turns=2, agent_max_tokens=64, seed=0,
                        dtype="float32", max_model_len=1024, max_num_seqs=8, group_id_prefix="v-")
    engine = VllmEngine(cfg)
    turns: dict[str, list[int]] = {}
    submit = engine.submit_tokens

    def recording(request_id: str, token_ids: Any, max_tokens: int, stop: Any) -> None:
        turns[request_id] = [int(t) for t in token_ids]
        submit(request_id, token_ids, max_tokens, stop)

    engine.submit_tokens = recording  # type: ignore[method-assign]
    with StoreWriter.from_config(cfg.stores, cfg.client) as writer, RolloutWorker(cfg, client=writer,
                                                                                 engine=engine) as worker:
        worker.run()
    Path(out).write_text(json.dumps({"rows": _stored_rows(location), "turns": turns,
                                     "observation": engine.encode("<result>408</result>")}))


if __name__ == "__main__":
    _vllm_driver(*sys.argv[1:])
