"""Partial rollouts (connectors.partial): samples interrupted by new weights resume from their prefix, each token
tagged with the version that sampled it.

The bookkeeping runs here on the scripted outputs of ``connectors.fake_engine`` (fast); the real engine is
checked in the weight-sync run of ``test_connectors_rollout.py`` (one vLLM start for both): a greedy group
interrupted mid-response by new weights resumes, and each resumed sample's tokens equal what the new weights
generate from that prefix uninterrupted.
"""

from __future__ import annotations

import pytest

from connectors.fake_engine import FakeCompletion, FakeFlatLogprobs, FakeRequestOutput
from connectors.partial import PartialGroups
from connectors.vllm import group_to_batch
from schemas.trajectory import normalize_group


def _delta(request: str, ids: list[int], *, finished: bool = False) -> FakeRequestOutput:
    lps = FakeFlatLogprobs.from_positions([[(t, -0.5)] for t in ids])
    done = FakeCompletion(index=0, token_ids=ids, logprobs=lps, finish_reason="stop" if finished else None)
    return FakeRequestOutput(request_id=request, prompt_token_ids=[], outputs=[done], finished=finished)


def test_interrupted_samples_resume_from_their_prefix_and_tag_each_token() -> None:
    groups = PartialGroups(max_tokens=6, version=3)
    first = groups.requests("g", [1, 2], 2)
    assert [(r, p, m) for r, p, m in first] == [("g#0.0", [1, 2], 6), ("g#1.0", [1, 2], 6)]
    assert groups.take([_delta("g#0.0", [10, 11]), _delta("g#1.0", [20], finished=True)]) == []
    running = groups.running()
    assert running == ["g#0.0"]  # the finished sample is not interrupted
    (again,) = groups.continuations(running, 4)
    assert again == ("g#0.1", [1, 2, 10, 11], 4)  # prompt ++ prefix, the budget left
    assert groups.take([_delta("g#0.0", [99])]) == []  # the aborted request's late delta is dropped
    (out,) = groups.take([_delta("g#0.1", [12, 13], finished=True)])
    assert [c.token_ids for c in out.outputs] == [[10, 11, 12, 13], [20]]
    assert [v.tolist() for v in out.token_versions] == [[3, 3, 4, 4], [3]]
    batch = group_to_batch(out, group_id="g", policy_version=4, policy_version_min=3, data_source="s",
                           token_versions=out.token_versions)
    (stored,) = normalize_group([batch], "g", 2)
    assert stored.column("token_versions").to_pylist() == [[3, 3, 4, 4], [3]]
    assert stored.column("response_logprobs").to_pylist() == [[-0.5] * 4, [-0.5]]


def test_a_sample_whose_budget_is_spent_finishes_at_the_load_and_dropped_groups_are_forgotten() -> None:
    groups = PartialGroups(max_tokens=2, version=0)
    groups.requests("a", [1], 1)
    groups.requests("b", [1], 1)
    groups.take([_delta("a#0.0", [5, 6]), _delta("b#0.0", [7])])
    assert groups.drop(["b"]) == ["b#0.0"] and not groups.owns("b#0.0")
    assert groups.continuations(groups.running(), 1) == []  # nothing left of a's budget
    (out,) = groups.take([])
    assert out.outputs[0].finish_reason == "length" and out.token_versions[0].tolist() == [0, 0]
    groups.requests("c", [1], 1)
    with pytest.raises(ValueError, match="already running"):
        groups.requests("c", [1], 1)
