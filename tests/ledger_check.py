"""One check, shared by the node-loss tests: every prompt the rollout wrote was trained exactly once.

Read from a run folder: ``metadata.parquet`` (every group the stores hold, with its rows' ``status``),
``consumed.parquet`` (the rows the trainer's planner consumed) and ``rollout.json`` (``redispatched``: each
group id of a prompt dispatched again -> the prompt's first group id). :func:`ledger_exact` checks the prompt
ledger ``knit run`` writes (``ledger.parquet``): the same rule in one table, with why each prompt went out again.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import polars as pl

from schemas.run_folder import read_document
from schemas.run_records import RolloutRecord


def each_prompt_trained_once(out: Path, *, group_size: int) -> dict[str, int]:
    """Assert that each prompt trained was trained as exactly one whole group, each row once, and that every group
    trained was written; returns ``prompts`` (trained), ``groups_written`` and ``regenerated`` (prompts trained
    under a later attempt's group id)."""
    meta = pl.read_parquet(out / "metadata.parquet")
    consumed = pl.read_parquet(out / "consumed.parquet")
    first_id = read_document(RolloutRecord, out / "rollout.json").redispatched
    trained = consumed.group_by("group_id").agg(rows=pl.len(), distinct=pl.col("sample_idx").n_unique())
    twice = trained.filter(pl.col("rows") != pl.col("distinct"))
    assert twice.is_empty(), f"rows trained twice: {twice}"
    partial = trained.filter(pl.col("rows") != group_size)
    assert partial.is_empty(), f"groups not trained whole: {partial}"
    per_prompt = Counter(first_id.get(g, g) for g in trained["group_id"])
    repeated = {p: n for p, n in per_prompt.items() if n > 1}
    assert not repeated, f"prompts trained more than once: {repeated}"
    written = set(meta["group_id"].unique())
    unknown = set(trained["group_id"]) - written
    assert not unknown, f"groups trained that no store holds: {sorted(unknown)}"
    return {"prompts": len(per_prompt), "groups_written": len(written),
            "regenerated": sum(1 for g in trained["group_id"] if g in first_id)}


def ledger_exact(out: Path, *, prompts: int) -> dict[str, int]:
    """Assert that ``out/ledger.parquet`` names ``prompts`` prompts, each trained by exactly one attempt, and that every
    attempt not trained says why; returns the attempts dispatched again, per reason."""
    ledger = pl.read_parquet(out / "ledger.parquet")
    per = ledger.group_by("prompt_id").agg(pl.col("trained_step").is_not_null().sum().alias("trained"))
    assert per.height == prompts, f"{per.height} prompts in the ledger, expected {prompts}"
    wrong = per.filter(pl.col("trained") != 1)
    bad = ledger.filter(pl.col("prompt_id").is_in(wrong["prompt_id"].implode()))
    assert wrong.is_empty(), f"prompts not trained exactly once: {bad}"
    unexplained = ledger.filter(pl.col("trained_step").is_null() & pl.col("dropped_reason").is_null())
    assert unexplained.is_empty(), f"attempts neither trained nor dropped for a reason: {unexplained}"
    again = ledger.filter(pl.col("attempt") > 0)["dispatch_reason"].fill_null("unknown").to_list()
    return dict(Counter(again))
