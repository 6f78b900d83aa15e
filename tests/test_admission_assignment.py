"""The rank split by links (``admission.assignment``): its guarantees under hypothesis, and where it wins.

Guarantees checked against LPT's split of the same groups: every group on exactly one rank, every rank with a
group when there are at least D, no rank's cost above 1.05 x LPT's largest, the busiest link's bytes / rate never
above LPT's; ``tokens`` is LPT itself.
"""

from __future__ import annotations

import numpy as np
import plans_reference as reference
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from admission import AdmissionConfig, LinkModel, assign_groups, balance_groups
from admission.assignment import BALANCE_SLACK, Network, lpt_ranks


def rank_of_groups(split: list[list[int]], groups: int) -> np.ndarray:
    """[groups] int: the rank of each group in ``split`` (a list of group indices per rank)."""
    out = np.full(groups, -1, dtype=np.int64)
    for r, members in enumerate(split):
        out[members] = r
    return out


@st.composite
def splits(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, list[str], AdmissionConfig]:
    groups = draw(st.integers(1, 40))
    ranks = draw(st.integers(1, 8))
    hosts = [f"h{i}" for i in range(draw(st.integers(1, 6)))]
    nodes = [f"n{i}" for i in range(draw(st.integers(1, 6)))]
    links = LinkModel(
        node_host={n: draw(st.sampled_from(hosts)) for n in nodes if draw(st.booleans())},
        rank_host=tuple(draw(st.sampled_from(hosts)) for _ in range(draw(st.integers(0, ranks)))),
        up_mbit={h: float(draw(st.integers(1, 400))) for h in hosts if draw(st.booleans())},
        down_mbit={h: float(draw(st.integers(1, 400))) for h in hosts if draw(st.booleans())},
    )
    costs = np.array([draw(st.integers(1, 5000)) for _ in range(groups)], dtype=np.float64)
    # bytes proportional to the cost, or not at all (images)
    nbytes = np.array([c * 8 if draw(st.booleans()) else draw(st.integers(1, 10**7)) for c in costs], np.float64)
    where = [draw(st.sampled_from(nodes)) for _ in range(groups)]
    cfg = AdmissionConfig(train_batch_groups=max(groups, ranks), group_size=1, dp_ranks=ranks, links=links)
    return costs, nbytes, where, cfg


@settings(max_examples=400, deadline=None)
@given(splits())
def test_the_links_split_keeps_balance_and_never_loads_a_link_more_than_lpt(
        case: tuple[np.ndarray, np.ndarray, list[str], AdmissionConfig]) -> None:
    costs, nbytes, nodes, cfg = case
    split = assign_groups(costs, nbytes, nodes, cfg)
    lpt = balance_groups(costs, cfg.dp_ranks)
    assert sorted(i for members in split for i in members) == list(range(len(costs)))
    if len(costs) >= cfg.dp_ranks:
        assert all(split)
    load = [costs[m].sum() for m in split]
    assert max(load) <= BALANCE_SLACK * max(costs[m].sum() for m in lpt) * (1 + 1e-9)
    net = Network.of(nodes, cfg.links, cfg.dp_ranks)
    busiest = net.busiest_link_s(rank_of_groups(split, len(costs)), nbytes)
    assert busiest <= net.busiest_link_s(rank_of_groups(lpt, len(costs)), nbytes) * (1 + 1e-12)
    tokens = AdmissionConfig(train_batch_groups=cfg.train_batch_groups, group_size=1, dp_ranks=cfg.dp_ranks,
                             links=cfg.links, assignment="tokens")
    assert assign_groups(costs, nbytes, nodes, tokens) == lpt


@settings(max_examples=400, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 4), st.integers(0, 10**6)), max_size=60), st.integers(1, 12),
       st.booleans())
def test_lpt_in_rounds_is_lpt_one_group_at_a_time(costs: list[int], ranks: int, squared: bool) -> None:
    c = np.array(costs, dtype=np.float64) ** (2 if squared else 1)  # small costs: ties, which end a round
    assert lpt_ranks(c, ranks).tolist() == reference.lpt_ranks(c, ranks)


def test_ranks_sharing_hosts_with_stores_read_them_locally() -> None:
    """Four hosts, a store and two ranks on each, the same work on every store: no byte crosses a link, where LPT
    sends most of them across."""
    rng = np.random.default_rng(0)
    hosts = [f"h{i}" for i in range(4)]
    links = LinkModel(node_host={f"n{i}": h for i, h in enumerate(hosts)},
                      rank_host=tuple(h for h in hosts for _ in "ab"))
    nodes = [f"n{i % 4}" for i in range(64)]
    costs = rng.integers(500, 600, 64).astype(np.float64)
    cfg = AdmissionConfig(train_batch_groups=64, group_size=1, dp_ranks=8, links=links)
    split = assign_groups(costs, costs * 8, nodes, cfg)
    net = Network.of(nodes, links, 8)
    assert net.busiest_link_s(rank_of_groups(split, 64), costs * 8) == 0.0
    assert net.busiest_link_s(rank_of_groups(balance_groups(costs, 8), 64), costs * 8) > 0.0
    assert max(costs[m].sum() for m in split) <= BALANCE_SLACK * max(costs[m].sum() for m in balance_groups(costs, 8))


def test_stores_apart_from_ranks_spread_bytes_over_the_ranks_downlinks() -> None:
    """Ranks on hosts of their own, groups of equal cost but a few heavy with images: the links split spreads the
    heavy groups, LPT (blind to bytes) may not; a slow downlink gets fewer bytes."""
    costs = np.full(16, 100.0)
    nbytes = np.array([10e6 if i < 4 else 1e5 for i in range(16)])
    nodes = [f"n{i % 2}" for i in range(16)]
    links = LinkModel(rank_host=("r0", "r1", "r2", "r3"), down_mbit={"r3": 10.0})
    cfg = AdmissionConfig(train_batch_groups=16, group_size=1, dp_ranks=4, links=links)
    split = assign_groups(costs, nbytes, nodes, cfg)
    heavy = [sum(i < 4 for i in members) for members in split]
    assert heavy[3] == 0 and max(heavy) <= 2
    net = Network.of(nodes, links, 4)
    assert net.busiest_link_s(rank_of_groups(split, 16), nbytes) < net.busiest_link_s(
        rank_of_groups(balance_groups(costs, 4), 16), nbytes)


def test_a_bad_link_model_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"down_mbit\['h1'\]"):
        LinkModel(down_mbit={"h1": 0.0})
    with pytest.raises(ValueError, match="assignment"):
        AdmissionConfig(train_batch_groups=2, group_size=1, assignment="bytes")  # type: ignore[arg-type]
