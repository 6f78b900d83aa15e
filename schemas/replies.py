"""Replies: the JSON a node answers an action or a DoPut with, one model per answer.

The server builds each answer as one of these models and sends :meth:`Reply.to_bytes`; the client
parses the same bytes with the same model (:meth:`Reply.from_bytes`), so both sides agree on every
field by construction, and a raw Flight client reads the documented JSON (``docs/protocol.md``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError


class ReplyError(ValueError):
    """An answer that does not parse as the reply it should be (names the reply and the field)."""


class Reply(BaseModel):
    """Base of every answer: frozen, unknown fields refused, JSON on the wire."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    def to_bytes(self) -> bytes:
        """The JSON that travels (fields left unset, e.g. a health answer's ``error``, are not sent)."""
        return self.model_dump_json(by_alias=True, exclude_unset=True).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> Any:
        """Parse an answer; :class:`ReplyError` names the reply and what was wrong."""
        try:
            return cls.model_validate_json(raw)
        except ValidationError as exc:
            errs = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '<root>'}: {e['msg']}" for e in exc.errors()[:5])
            msg = f"invalid {cls.__name__} answer: {errs}"
            raise ReplyError(msg) from None


# ---- actions -------------------------------------------------------------------------------------


class HealthReply(Reply):
    """``health``: the node is alive. A client reports a node it cannot reach as ``ok=False`` with ``error``."""

    ok: bool
    node: str
    """The node's name (its id for routing)."""
    schema_version: int | None = None
    """The wire schema version the node speaks (absent for a node that could not be reached)."""
    error: str | None = None
    """Why the node could not be reached (set by the client, never sent by a node)."""


class ClusterNode(Reply):
    """One node of a cluster view: its id (what routing runs over) and where clients reach it."""

    id: str
    location: str


class ClusterReply(Reply):
    """``cluster``: the routing, the view's version, the nodes, and this node's own id (``self`` on the wire)."""

    routing: str
    version: int
    self_id: str = Field(validation_alias=AliasChoices("self", "self_id"), serialization_alias="self")
    """This node's id (``self`` on the wire)."""
    nodes: list[ClusterNode]
    down: list[str] = []
    """Ids of members routing leaves out now (found down by whoever watches the nodes): their groups go to the
    others until a newer view brings them back."""


class GroupCounts(Reply):
    """Groups of one node by state."""

    stored: int
    """Stored and not released."""
    released: int
    """Released by the trainer (their metadata history stays)."""
    inflight: int
    """Registered in flight (dispatched, rows not written yet)."""


class NodeStats(Reply):
    """``stats``: one node's counters (also what its Prometheus endpoint exports)."""

    node: str
    schema_version: int
    rows: int
    """Trajectory rows held (unreleased groups)."""
    rows_stored: int
    """Trajectory rows ever stored."""
    metadata_rows: int
    """Rows ever appended to the metadata log (its next ``seq``)."""
    metadata_rows_held: int
    tombstones: int
    spill_bytes: int
    spill_compactions: int
    groups: GroupCounts
    demand: dict[str, int]
    """Groups per data source the trainer needs and nothing running brings (the ``demand`` action)."""
    bytes: int
    """Payload bytes held."""
    images: int
    image_bytes: int
    weights_version: int | None
    """Version of the newest weights held (``None`` before any)."""
    policy_version: int
    """The newest published policy version."""
    memory_budget: int | None
    memory_used: int
    memory_in_flight: int
    memory_rss: int | None
    """Resident memory of the node process (``None`` without the RSS guard)."""
    memory_rss_limit: int | None
    bytes_in: int
    bytes_out: int
    uptime_s: float
    writers: int = 0
    """DoPuts receiving now (the server's part of the answer)."""
    writes_given_up: int = 0
    """DoPuts the server gave up on (their client stalled past the idle limit)."""
    writes_evicted: int = 0
    """DoPuts whose slot went to a new writer (idle past ``write_evict_idle_s`` while the node was full)."""


class ReleaseReply(Reply):
    """``release``: how many groups this node freed."""

    released: int


class VersionReply(Reply):
    """``publish_version`` and ``get_version``: the newest published policy version."""

    version: int


class DispatchReply(Reply):
    """``dispatch``: how many groups were registered, and the ids already written (so not registered)."""

    registered: int
    stored: list[str]


class ResolveReply(Reply):
    """``resolve``: how many groups were taken out of flight."""

    resolved: int


class DemandReply(Reply):
    """``demand``: the demand now recorded."""

    demand: dict[str, int]


class InflightGroup(Reply):
    """One group in flight, as its rollout registered it."""

    group_id: str
    data_source: str
    prompt_id: str
    dispatch_version: int
    state: Literal["queued", "running"]
    dispatched_at: float
    """Unix time of its first registration."""


class InflightReply(Reply):
    """``inflight``: the groups in flight on one node, with the registration and resolution counts."""

    groups: list[InflightGroup]
    registered_total: int
    """Registrations the node ever received."""
    resolved: dict[str, int]
    """Groups taken out of flight, per reason (``written`` when its rows arrived)."""


# ---- DoPut answers -------------------------------------------------------------------------------


class PutGroupReply(Reply):
    """A ``put_group`` DoPut: rows added (0 for a rewrite of the same content)."""

    group_id: str
    rows_added: int


class RefusedGroup(Reply):
    """A group a bulk write refused: the typed error's JSON (``flight_store.errors.error_info``)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    error: str
    message: str
    retryable: bool


class PutGroupsReply(Reply):
    """A ``put_groups`` DoPut: the rows added per stored group, and each refused group's error."""

    stored: dict[str, int]
    refused: dict[str, RefusedGroup]


class PutImagesReply(Reply):
    """A ``put_images`` DoPut: how many images were new."""

    stored: int


class PutWeightsReply(Reply):
    """A ``put_weights`` DoPut: whether the version was kept (an older one than the latest is not)."""

    version: int
    stored: bool


ACTION_REPLIES: dict[str, type[Reply]] = {
    "health": HealthReply,
    "cluster": ClusterReply,
    "stats": NodeStats,
    "release": ReleaseReply,
    "publish_version": VersionReply,
    "get_version": VersionReply,
    "dispatch": DispatchReply,
    "resolve": ResolveReply,
    "demand": DemandReply,
    "inflight": InflightReply,
    "set_cluster": ClusterReply,
}
"""Action type -> the model of its answer (the same keys as ``schemas.wire.ACTION_BODIES``)."""

ACTION_DESCRIPTIONS: dict[str, str] = {
    "health": 'liveness; answers {"ok": true, "node": ..., "schema_version": ...}',
    "cluster": 'the cluster view: {"routing": "home-rendezvous-sha256", "version": N, "nodes": [{"id", "location"}], '
               '"self": id, "down": [ids]}; a group belongs to the node routing picks from "nodes" not "down"',
    "stats": "rows, bytes, groups by state, images, memory budget and use, bytes in/out",
    "release": 'free the payload of consumed groups; body {"v":3,"group_ids":[...]}',
    "publish_version": 'record the newest policy version; body {"v":3,"version":N}',
    "get_version": 'the newest published policy version; answers {"version": N}',
    "dispatch": 'register groups in flight (queued or running) with their quota class; body {"v":3,"groups":[...]}; '
                'answers {"registered": N, "stored": [ids already written, so not registered]}',
    "resolve": 'take groups out of flight without rows; body {"v":3,"group_ids":[...],"reason":"aborted"}',
    "demand": 'groups per data_source the trainer needs and nothing running brings (shown in stats); '
              'body {"v":3,"classes":{"math":2}}',
    "set_cluster": 'a newer cluster view: body {"v":3,"version":N,"down":[ids]}; routing leaves the down ids out; '
                   'a version not above the node\'s changes nothing; answers as cluster',
    "inflight": 'the groups in flight here: {"groups": [{"group_id", "data_source", "prompt_id", '
                '"dispatch_version", "state", "dispatched_at"}], "registered_total": N, "resolved": {reason: N}}',
}
"""What ``list_actions`` says of each action (its body, ``schemas.wire.ACTION_BODIES``, and its answer)."""
