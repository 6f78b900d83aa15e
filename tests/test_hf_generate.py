"""The own-engine example (``connectors.hf_generate``): plain transformers ``generate()`` writes groups the store
takes and a trainer can admit, their logprobs the model's own forward."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl
import pytest

from flight_store.reading import StoreReader
from schemas.plan import PlannedSlice

pytestmark = pytest.mark.slow


def test_hf_generate_writes_whole_groups_whose_logprobs_are_the_model_s_forward(  # type: ignore[no-untyped-def]
        store_nodes, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from connectors.hf_generate import main
    from connectors.tiny_model import build_tiny_llama

    model_dir = build_tiny_llama(tmp_path / "tiny", layers=1, hidden=64, heads=2, kv_heads=1)
    nodes = [s.location for s in store_nodes(2)]
    assert main(["--model", str(model_dir), "--stores", ",".join(nodes), "--groups", "3", "--group-size", "4",
                 "--max-tokens", "12", "--prefix", "ex"]) == 0
    assert "wrote 3 groups of 4: ex-0, ex-1, ex-2" in capsys.readouterr().out
    with StoreReader(nodes) as client:
        meta = client.scan_metadata()
        assert sorted(meta["group_id"].unique()) == ["ex-0", "ex-1", "ex-2"]
        assert meta.group_by("group_id").len()["len"].to_list() == [4, 4, 4]
        assert set(meta["status"]) == {"completed"} and set(meta["finish_reason"]) <= {"stop", "length"}
        slices = [PlannedSlice(node=n, group_id=g, start=0, stop=4)
                  for n, g in meta.select("node", "group_id").unique().sort("group_id").iter_rows()]
        table = client.fetch(slices, columns=["prompt_ids", "response_ids", "response_logprobs"])
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    for prompt, response, lps in zip(*(table.column(c).to_pylist() for c in table.column_names), strict=True):
        assert 1 <= len(response) <= 12 and len(lps) == len(response)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + response])).logits[0].log_softmax(-1)
        forward = [float(logits[len(prompt) - 1 + i, t]) for i, t in enumerate(response)]
        np.testing.assert_allclose(lps, forward, atol=1e-4, rtol=0)
    assert meta.filter(pl.col("response_len") > 0).height == 12
