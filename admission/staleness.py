"""Staleness (docs/design.md): per trajectory, per mini-batch (optimizer step) and per run, in two parts.

A trajectory whose first token came from policy version ``v_start`` (``policy_version_min``) and its
last from ``v`` (``policy_version``: the rollout loads new weights into running requests), consumed at
step s = tK + k, is stale by two parts that add up:

* its **generation span** ``v - v_start``: the weight updates that landed while it was generated,
  which no admission policy can remove (only shorter responses or fewer in-flight updates can);
* its **architectural staleness** ``arch = max(0, tK - v)``: what the pipeline added while the
  finished trajectory waited, against a colocated run that would train it at tK (the part k comes
  from the algorithm, K optimizer steps per train batch). ``signed = tK - v`` keeps the sign
  (negative where streaming consumed fresher data than a colocated run would).

``total = arch + span``. Token-weighted means weight each trajectory by its trained tokens (``loss_tokens``: the
tokens the stale policy generated and the step trains on; a multi-turn response's tool tokens are not among them).
"""

from __future__ import annotations

import dataclasses

import polars as pl

STALENESS_COLUMNS: tuple[str, ...] = ("arch_staleness", "signed_staleness", "generation_span", "total_staleness")


def staleness_exprs(mini_batches: int) -> list[pl.Expr]:
    """Expressions adding :data:`STALENESS_COLUMNS` from ``train_batch``, ``policy_version`` and
    ``policy_version_min``."""
    signed = pl.col("train_batch").cast(pl.Int64) * mini_batches - pl.col("policy_version").cast(pl.Int64)
    span = (pl.col("policy_version").cast(pl.Int64) - pl.col("policy_version_min").cast(pl.Int64)).clip(lower_bound=0)
    return [signed.clip(lower_bound=0).alias("arch_staleness"), signed.alias("signed_staleness"),
            span.alias("generation_span"), (signed.clip(lower_bound=0) + span).alias("total_staleness")]


def _aggs(columns: list[str]) -> list[pl.Expr]:
    """The figures of :class:`StalenessSummary`; a row weighs its trained tokens (``loss_tokens``, the response
    length when the frame lacks it)."""
    w = pl.col("loss_tokens" if "loss_tokens" in columns else "response_len").cast(pl.Float64)
    out = [pl.len().alias("trajectories")]
    for col, name in (("arch_staleness", "arch"), ("generation_span", "span"), ("total_staleness", "total")):
        out += [pl.col(col).mean().alias(f"{name}_mean"),
                ((pl.col(col) * w).sum() / w.sum()).alias(f"{name}_token_weighted"),
                pl.col(col).max().alias(f"{name}_max")]
    return [*out, pl.col("signed_staleness").mean().alias("signed_mean")]


def per_step(consumed: pl.DataFrame) -> pl.DataFrame:
    """Staleness metrics per optimizer step (mini-batch), sorted by step."""
    return consumed.group_by("step").agg(_aggs(consumed.columns)).sort("step")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StalenessSummary:
    """A run's staleness (:func:`summary`), in policy versions: means, token-weighted means and maxima."""

    trajectories: int
    arch_mean: float
    arch_token_weighted: float
    arch_max: float
    span_mean: float
    span_token_weighted: float
    span_max: float
    total_mean: float
    total_token_weighted: float
    total_max: float
    signed_mean: float

    def to_dict(self) -> dict[str, float]:
        """The summary as a JSON-ready mapping, one key per field."""
        return dataclasses.asdict(self)


def summary(consumed: pl.DataFrame) -> StalenessSummary:
    """Run-level metrics: trajectories; mean, token-weighted mean and max of arch, span and total; signed_mean."""
    if consumed.height == 0:
        return StalenessSummary(trajectories=0, **{f"{n}_{a}": 0.0 for n in ("arch", "span", "total")
                                                    for a in ("mean", "token_weighted", "max")}, signed_mean=0.0)
    if "generation_span" not in consumed.columns:  # a consumed frame with the architectural part only
        consumed = consumed.with_columns(pl.lit(0).alias("generation_span"),
                                         pl.col("arch_staleness").alias("total_staleness"))
    row = consumed.select(_aggs(consumed.columns)).row(0, named=True)
    figures = {k: (float(v) if v is not None else 0.0) for k, v in row.items() if k != "trajectories"}
    return StalenessSummary(trajectories=int(row["trajectories"]), **figures)
