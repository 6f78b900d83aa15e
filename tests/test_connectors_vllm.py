"""connectors.vllm (RequestOutput -> trajectory batch), connectors.tasks (rewards), connectors.engine_weights (tables).

Engine outputs here are the fakes of ``connectors.fake_engine``; the real engine runs in
``test_connectors_rollout.py``.
"""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap
from datetime import datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from connectors.fake_engine import FakeCompletion, FakeFlatLogprobs, FakeLogprob, FakeRequestOutput
from connectors.tasks import (
    ARITHMETIC_TASKS,
    IMAGE_TASKS,
    REWARDS,
    ArithmeticTask,
    RewardFn,
    SquaresTask,
    digit_reward,
    exact_match_reward,
    jsonl_prompts,
    load_reward_fn,
    mixed_prompts,
)
from connectors.vllm import (
    LOGPROBS_MODE_KEY,
    aborted_batch,
    group_to_batch,
    require_vllm,
    sampled_logprobs,
)
from schemas.arrow import TRAJECTORY_SCHEMA
from schemas.images import image_key

ROOT = Path(__file__).resolve().parents[1]


def _flat_output(n: int = 3, *, top: int = 0, seed: int = 0, lengths: list[int] | None = None) -> FakeRequestOutput:
    """n samples; each position has the sampled token first, then ``top`` other candidates."""
    rng = np.random.default_rng(seed)
    outs = []
    for i in range(n):
        length = lengths[i] if lengths else 5 + i
        ids = rng.integers(0, 500, size=length).tolist()
        positions = []
        for t in ids:
            entries = [(t, float(np.float32(-rng.random() * 6)))]
            entries += [(int(rng.integers(500, 600)), float(np.float32(-rng.random()))) for _ in range(top)]
            positions.append(entries)
        outs.append(FakeCompletion(index=i, token_ids=ids, logprobs=FakeFlatLogprobs.from_positions(positions)))
    return FakeRequestOutput(request_id="r", prompt_token_ids=[1, 2, 3, 4], outputs=outs[::-1])  # out of order


# ---- sampled_logprobs ---------------------------------------------------------------------------


@pytest.mark.parametrize("top", [0, 2])
def test_sampled_logprobs_flat_picks_first_entry_per_position(top: int) -> None:
    out = _flat_output(1, top=top)
    c = out.outputs[0]
    got = sampled_logprobs(c.logprobs, c.token_ids)
    fl = c.logprobs
    want = np.array([fl.logprobs[s] for s in fl.start_indices], dtype=np.float32)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, want)


def test_sampled_logprobs_flat_searches_when_sampled_is_not_first() -> None:
    fl = FakeFlatLogprobs.from_positions([[(7, -3.0), (5, -0.5)], [(9, -1.25)]])
    np.testing.assert_array_equal(sampled_logprobs(fl, [5, 9]), np.array([-0.5, -1.25], np.float32))
    with pytest.raises(ValueError, match="sampled token 4 missing"):
        sampled_logprobs(fl, [4, 9])


def test_sampled_logprobs_list_form_and_errors() -> None:
    lst = [{5: FakeLogprob(-0.5), 7: FakeLogprob(-3.0)}, {9: FakeLogprob(-1.25)}]
    np.testing.assert_array_equal(sampled_logprobs(lst, [5, 9]), np.array([-0.5, -1.25], np.float32))
    with pytest.raises(ValueError, match="2 positions for 3"):
        sampled_logprobs(lst, [5, 9, 1])
    with pytest.raises(ValueError, match="no logprobs"):
        sampled_logprobs(None, [1])
    assert sampled_logprobs(None, []).shape == (0,)
    with pytest.raises(ValueError, match="positions for"):
        sampled_logprobs(FakeFlatLogprobs.from_positions([[(1, -1.0)]]), [1, 2])


# ---- group_to_batch -----------------------------------------------------------------------------


def test_group_to_batch_columns_match_the_output() -> None:
    out = _flat_output(3, top=1)
    t0 = datetime(2026, 1, 1, 12, 0, 0)
    batch = group_to_batch(out, group_id="g7", policy_version=5, policy_version_min=4, data_source="add_small",
                           rewards=[1.0, 0.0, 0.5], created_at=t0, logprobs_mode="processed_logprobs")
    assert batch.schema.remove_metadata().equals(TRAJECTORY_SCHEMA.remove_metadata())
    assert batch.schema.metadata[LOGPROBS_MODE_KEY] == b"processed_logprobs"
    d = batch.to_pydict()
    assert d["sample_idx"] == [0, 1, 2]
    assert d["group_id"] == ["g7"] * 3
    assert d["policy_version"] == [5] * 3 and d["policy_version_min"] == [4] * 3
    assert d["reward"] == [1.0, 0.0, 0.5]
    assert d["created_at"] == [t0] * 3
    assert d["status"] == ["completed"] * 3
    assert d["prompt_ids"] == [[1, 2, 3, 4]] * 3 and d["prompt_len"] == [4] * 3
    by_idx = {c.index: c for c in out.outputs}
    for i in range(3):
        c = by_idx[i]
        assert d["response_ids"][i] == c.token_ids
        assert d["response_len"][i] == len(c.token_ids)
        want = np.float32([c.logprobs.logprobs[s] for s in c.logprobs.start_indices])
        np.testing.assert_array_equal(np.float32(d["response_logprobs"][i]), want)
        assert d["loss_mask"][i] == [1] * len(c.token_ids)
        assert d["image_keys"][i] == [] and d["num_images"][i] == 0


def test_group_to_batch_marks_aborted_and_missing_samples() -> None:
    out = _flat_output(2)
    out.outputs[0].finish_reason = "abort"  # index 1 (outputs are reversed)
    batch = group_to_batch(out, group_id="g", policy_version=0, data_source="s", group_size=4)
    d = batch.to_pydict()
    assert d["status"] == ["completed", "aborted", "aborted", "aborted"]
    assert d["finish_reason"] == ["length", "abort", "abort", "abort"]
    assert d["response_len"][2:] == [0, 0]
    assert d["loss_mask"][1] == [0] * d["response_len"][1]
    forced = group_to_batch(_flat_output(2), group_id="g", policy_version=0, data_source="s", status="aborted")
    assert forced.column("status").to_pylist() == ["aborted", "aborted"]


def test_group_to_batch_refuses_bad_input() -> None:
    out = _flat_output(2)
    with pytest.raises(ValueError, match="2 samples"):
        group_to_batch(out, group_id="g", policy_version=0, data_source="s", group_size=1)
    with pytest.raises(ValueError, match="1 rewards for 2"):
        group_to_batch(out, group_id="g", policy_version=0, data_source="s", rewards=[1.0])
    with pytest.raises(ValueError, match="raw_logits"):
        group_to_batch(out, group_id="g", policy_version=0, data_source="s", logprobs_mode="raw_logits")
    with pytest.raises(ValueError, match="policy_version_min' row 0: 3 > policy_version 2"):
        group_to_batch(out, group_id="g", policy_version=2, policy_version_min=3, data_source="s")
    with pytest.raises(ValueError, match="image key of 3 bytes"):
        group_to_batch(out, group_id="g", policy_version=0, data_source="s", image_keys=[b"abc"])
    out.outputs[0].logprobs = None  # a completed sample without logprobs is an error, not a silent zero
    with pytest.raises(ValueError, match="no logprobs"):
        group_to_batch(out, group_id="g", policy_version=0, data_source="s")


def test_group_to_batch_references_image_keys_on_every_row() -> None:
    imgs = [np.random.default_rng(i).integers(0, 255, (3, 8, 8), dtype=np.uint8) for i in range(2)]
    keys = [image_key(a) for a in imgs]
    batch = group_to_batch(_flat_output(4), group_id="g", policy_version=0, data_source="s", image_keys=keys)
    assert batch.column("image_keys").to_pylist() == [keys] * 4
    assert batch.column("num_images").to_pylist() == [2] * 4


def test_images_stored_per_row_are_the_same_pixels_under_keys_of_their_own() -> None:
    from schemas.images import group_images, table_to_images

    imgs = [np.random.default_rng(i).integers(0, 255, (8, 8, 3), dtype=np.uint8) for i in range(2)]
    once, shared = group_images(imgs, 3)
    assert once.num_rows == 2 and shared == [[image_key(a) for a in imgs]] * 3
    table, per_row = group_images(imgs, 3, per_row=True)
    assert table.num_rows == 6 and len({k for row in per_row for k in row}) == 6
    assert per_row[0] == shared[0]  # row 0's copies are the images themselves
    stored = table_to_images(table)
    for row in per_row:  # every copy holds the image's pixels, under unit axes a reader drops
        for img, k in zip(imgs, row, strict=True):
            assert np.array_equal(stored[k].reshape(img.shape), img)
    batch = group_to_batch(_flat_output(3), group_id="g", policy_version=0, data_source="s", image_keys=per_row)
    assert batch.column("image_keys").to_pylist() == per_row
    assert batch.column("num_images").to_pylist() == [2] * 3
    with pytest.raises(ValueError, match="image keys for 3 rows, 4 samples"):
        group_to_batch(_flat_output(4), group_id="g", policy_version=0, data_source="s", image_keys=per_row)


def test_aborted_batch_keeps_every_row() -> None:
    b = aborted_batch(group_id="g", group_size=3, prompt_token_ids=[4, 5], policy_version=2, data_source="s",
                      finish_reason="error")
    d = b.to_pydict()
    assert d["status"] == ["aborted"] * 3 and d["finish_reason"] == ["error"] * 3
    assert d["response_ids"] == [[]] * 3 and d["prompt_ids"] == [[4, 5]] * 3


# ---- imports ------------------------------------------------------------------------------------


def test_connectors_import_neither_vllm_nor_torch() -> None:
    code = textwrap.dedent(
        """
        import sys
        import connectors, connectors.vllm, connectors.rollout, connectors.tasks, connectors.engine_weights
        import connectors.tiny_model, connectors.fake_engine, connectors.config, connectors.engine
        print(sorted(m for m in ("vllm", "torch", "transformers", "megatron") if m in sys.modules))
        """
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         check=True)
    assert res.stdout.strip() == "[]"


def test_require_vllm_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    with pytest.raises(ImportError, match=r"pip install knittrans\[vllm\]"):
        require_vllm()


# ---- tasks and rewards --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("answer", "response", "reward"),
    [
        ("12", "The answer is 12.", 1.0),
        ("12", "12", 1.0),
        ("12", "(12) and more", 1.0),
        ("12", "x=12,", 1.0),
        ("12", "123", 0.0),
        ("12", "512", 0.0),
        ("12", "-12", 0.0),
        ("12", "1 2", 0.0),
        ("12", "", 0.0),
        ("-12", "it is -12", 1.0),
        ("-12", "it is 12", 0.0),
        ("0", "0", 1.0),
        ("0", "10", 0.0),
        ("123456", "answer: 123456", 1.0),
    ],
)
def test_exact_match_reward(answer: str, response: str, reward: float) -> None:
    assert exact_match_reward("q", response, {"answer": answer}) == reward


def test_exact_match_reward_needs_an_integer_answer() -> None:
    with pytest.raises(ValueError, match="integer 'answer'"):
        exact_match_reward("q", "1", {"answer": "one"})


def test_digit_reward_varies_within_a_group() -> None:
    assert digit_reward("", "12 34", {}) == 1.0
    assert digit_reward("", "ab", {}) == 0.0
    assert digit_reward("", "a1", {}) == 0.5
    assert digit_reward("", "   ", {}) == 0.0


def test_arithmetic_tasks_are_correct_and_differ_in_difficulty() -> None:
    rng = random.Random(0)
    for name, task in ARITHMETIC_TASKS.items():
        for _ in range(50):
            p = task.make(rng)
            assert p.data_source == name
            a, op, b = p.text.split("?")[0].removeprefix("What is ").split()
            want = int(a) + int(b) if op == "+" else int(a) * int(b)
            assert p.sample["answer"] == str(want)
            assert exact_match_reward(p.text, f"so {want}!", p.sample) == 1.0
            assert exact_match_reward(p.text, f"so {want + 1}!", p.sample) == 0.0
    small = [int(ARITHMETIC_TASKS["add_small"].make(rng).sample["answer"]) for _ in range(100)]
    large = [int(ARITHMETIC_TASKS["mul_large"].make(rng).sample["answer"]) for _ in range(100)]
    assert max(small) <= 18 and min(large) >= 10_000
    with pytest.raises(ValueError, match="op '-'"):
        ArithmeticTask(name="x", op="-", low=0, high=1)


def test_the_squares_task_draws_as_many_separate_squares_as_its_answer_from_the_seed_alone() -> None:
    from scipy import ndimage

    task = IMAGE_TASKS["squares"]
    seen = set()
    for i in range(40):
        p = task.make(random.Random(i))
        (image,) = p.images
        assert image.shape == (56, 56, 3) and image.dtype == np.uint8 and p.text.startswith("<image>")
        _, blobs = ndimage.label(image.any(-1))
        assert str(blobs) == p.sample["answer"]
        assert exact_match_reward(p.text, f"There are {blobs}.", p.sample) == 1.0
        seen.add(blobs)
        again = task.make(random.Random(i))
        assert again.sample == p.sample and np.array_equal(again.images[0], image)
    assert seen == {1, 2, 3, 4}
    with pytest.raises(ValueError, match="high <= 4"):
        SquaresTask(name="x", high=5)
    mixed = mixed_prompts({"squares": 1, "add_small": 1}, seed=0, chunk=2)
    assert sorted(next(mixed).data_source for _ in range(2)) == ["add_small", "squares"]


def test_mixed_prompts_follow_the_mix() -> None:
    it = mixed_prompts({"add_small": 3, "mul_large": 1}, seed=1)
    sources = [next(it).data_source for _ in range(400)]
    share = sources.count("add_small") / len(sources)
    assert 0.65 < share < 0.85
    with pytest.raises(ValueError, match="unknown data sources"):
        next(mixed_prompts({"nope": 1}))


def test_jsonl_prompts_and_reward_hooks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "2+2?", "answer": "4", "data_source": "toy"}\n\n{"prompt": "hi"}\n')
    ps = list(jsonl_prompts(f))
    assert [p.data_source for p in ps] == ["toy", "default"]
    assert ps[0].sample == {"answer": "4", "data_source": "toy"}
    (tmp_path / "bad.jsonl").write_text("{oops\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:1"):
        list(jsonl_prompts(tmp_path / "bad.jsonl"))

    assert load_reward_fn("exact") is exact_match_reward and load_reward_fn("digits") is digit_reward
    assert sorted(REWARDS) == ["digits", "exact"]
    fn = load_reward_fn("connectors.tasks:exact_match_reward")
    assert fn is exact_match_reward and isinstance(fn, RewardFn)

    # a user's own reward, by "module:function"
    (tmp_path / "my_rewards.py").write_text(
        "def mine(prompt, response, sample):\n    return float(len(response))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_reward_fn("my_rewards:mine")("p", "abc", {}) == 3.0
    with pytest.raises(ValueError, match="no callable 'nope'"):
        load_reward_fn("connectors.tasks:nope")
    with pytest.raises(ValueError, match="cannot import module"):
        load_reward_fn("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="module:function"):
        load_reward_fn("just_a_name")
    with pytest.raises(ValueError, match="module:function"):
        load_reward_fn("a:b:c")


# ---- weights tables -----------------------------------------------------------------------------


def test_weights_table_round_trip() -> None:
    torch = pytest.importorskip("torch")
    from connectors.engine_weights import table_to_ipc, table_to_tensors
    from schemas.weights import WEIGHTS_SCHEMA, WeightsError, from_tensors

    g = torch.Generator().manual_seed(0)
    named = [
        ("model.embed_tokens.weight", torch.randn(7, 4, generator=g)),
        ("model.norm.weight", torch.randn(4, generator=g).to(torch.bfloat16)),
        ("lm_head.weight", torch.randn(7, 4, generator=g).to(torch.float16).t()),  # non-contiguous
        ("scalar", torch.tensor(3.5)),
    ]
    table = from_tensors(named, torch)
    assert table.schema.equals(WEIGHTS_SCHEMA)
    back = dict(table_to_tensors(table))
    for name, t in named:
        assert back[name].dtype == t.dtype and back[name].shape == t.shape
        assert torch.equal(back[name], t)
    assert pa.ipc.open_stream(pa.py_buffer(table_to_ipc(table))).read_all().equals(table)
    bad = table.set_column(1, "shape", pa.array([[7, 5], [4], [4, 7], []], pa.list_(pa.int32())))
    with pytest.raises(WeightsError, match="has 112 bytes of data, but shape \\[7, 5\\] of float32 needs 140"):
        table_to_tensors(bad)
