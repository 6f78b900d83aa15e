"""Wire documents: Flight descriptors, tickets and action bodies, as small versioned JSON.

Every document is a JSON object with ``"v"`` (the schema version) and ``"kind"``; any Flight client, in any language,
can build them by hand (docs/protocol.md shows each). The ``decode_*`` functions below are the only places that parse
them; they raise :class:`WireError` naming what was wrong.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from schemas.arrow import IMAGE_KEY_BYTES, SCHEMA_VERSION


class WireError(ValueError):
    """A descriptor, ticket or action body that cannot be decoded (bad JSON, version, field)."""


class WireLimitError(WireError):
    """A document over one of the documented limits; ``limit`` names it, ``value`` is what was sent."""

    def __init__(self, message: str, *, limit: str, value: int) -> None:
        super().__init__(message)
        self.limit = limit
        self.value = value


LIMITS: dict[str, int] = {
    "descriptor_bytes": 64 << 10,
    "ticket_bytes": 4 << 20,
    "action_body_bytes": 4 << 20,
    "slices_per_ticket": 8192,
    "keys_per_ticket": 4096,
    "groups_per_release": 65536,
    "groups_per_list": 1000,
    "groups_per_put": 1024,
}
"""The wire's limits (docs/protocol.md, Limits): bytes of a document, entries of its lists, FlightInfos per ListFlights.
A request over one is refused (``LimitExceededError`` naming it) before it is parsed further."""
_LIST_LIMITS = {"slices": "slices_per_ticket", "keys": "keys_per_ticket", "group_ids": "groups_per_release",
                "groups": "groups_per_put"}


class _Doc(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    v: int = SCHEMA_VERSION
    """Schema version the writer speaks; must equal ``SCHEMA_VERSION``."""

    @model_validator(mode="after")
    def _check_version(self) -> _Doc:
        if self.v != SCHEMA_VERSION:
            msg = f"unsupported schema version v={self.v}; this store speaks v={SCHEMA_VERSION}"
            raise ValueError(msg)
        return self

    def to_bytes(self) -> bytes:
        """Compact JSON, the form that travels."""
        return self.model_dump_json(exclude_none=True).encode()


GROUP_ID_MAX_CHARS, MAX_NON_NEG = 512, 2**62
"""The longest group id (characters), the largest row index or count a document carries."""
GroupId = Annotated[str, Field(min_length=1, max_length=GROUP_ID_MAX_CHARS)]
NonNegInt = Annotated[int, Field(ge=0, le=MAX_NON_NEG)]
Version = Annotated[int, Field(ge=0, lt=2**31)]
"""A policy version: optimizer steps, below 2^31."""
MAX_GROUP_ROWS = 1 << 16
"""Most trajectories one prompt group may hold (G)."""


# ---- DoPut descriptors (FlightDescriptor.for_command) --------------------------------------------


class PutGroup(_Doc):
    """DoPut one whole prompt group, atomically: the stream carries exactly ``rows`` trajectory-schema rows
    of this group (in one or more batches), ``sample_idx`` 0..rows-1 in any order.

    The group is committed only when the stream ends (the client's half-close) with all ``rows`` rows
    and they validate; any other ending stores nothing.

    Example: ``{"v": 3, "kind": "put_group", "group_id": "step3-prompt17", "rows": 4}``
    """

    kind: Literal["put_group"] = "put_group"
    group_id: GroupId
    rows: Annotated[int, Field(ge=1, le=MAX_GROUP_ROWS)]
    """The group's trajectories (G): the stream must carry exactly this many rows."""


class GroupRows(BaseModel):
    """One group of a :class:`PutGroups` stream: its id and its rows (G)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    group_id: GroupId
    rows: Annotated[int, Field(ge=1, le=MAX_GROUP_ROWS)]


class PutGroups(_Doc):
    """DoPut several whole prompt groups in one stream: ``groups[0]``'s rows first, then ``groups[1]``'s, ...

    Each group is validated and committed on its own, as one :class:`PutGroup` would be, once the
    stream ends; a group that fails is refused alone and named in the answer (``{"stored":
    {group_id: rows_added}, "refused": {group_id: {"error", "message", "retryable", ...}}}``),
    the others are stored. A stream that does not end cleanly, or whose rows do not add up to the
    groups', stores nothing.

    Example: ``{"v": 3, "kind": "put_groups", "groups": [{"group_id": "s3-p17", "rows": 4},
    {"group_id": "s3-p18", "rows": 4}]}``
    """

    kind: Literal["put_groups"] = "put_groups"
    groups: Annotated[list[GroupRows], Field(min_length=1)]

    @model_validator(mode="after")
    def _distinct(self) -> PutGroups:
        ids = [g.group_id for g in self.groups]
        if len(set(ids)) != len(ids):
            dup = next(g for g in ids if ids.count(g) > 1)
            msg = f"group {dup!r} is listed more than once"
            raise ValueError(msg)
        return self


class GroupRef(_Doc):
    """Names a stored group, for GetFlightInfo (and the descriptor of ListFlights' answers).

    Example: ``{"v": 3, "kind": "group", "group_id": "step3-prompt17"}``
    """

    kind: Literal["group"] = "group"
    group_id: GroupId


class PutImages(_Doc):
    """DoPut rows of the image table; keys already stored are skipped.

    Example: ``{"v": 3, "kind": "put_images"}``
    """

    kind: Literal["put_images"] = "put_images"


class PutWeights(_Doc):
    """DoPut a table of named tensors (``name``, ``shape``, ``dtype``, ``data``) as weights ``version``.

    Example: ``{"v": 3, "kind": "put_weights", "version": 4}``
    """

    kind: Literal["put_weights"] = "put_weights"
    version: Version


Descriptor = Annotated[PutGroup | PutGroups | PutImages | PutWeights | GroupRef, Field(discriminator="kind")]


# ---- DoGet tickets -----------------------------------------------------------------------------


class MetadataTicket(_Doc):
    """Metadata rows with ``seq >= since`` (the cursor), projected to ``columns``.

    Example: ``{"v": 3, "kind": "metadata", "since": 0, "columns": ["group_id", "reward"]}``
    """

    kind: Literal["metadata"] = "metadata"
    since: NonNegInt = 0
    columns: list[str] | None = None
    """Metadata columns to return (``seq`` always comes first); ``None`` = all."""


class SliceRef(BaseModel):
    """Rows ``sample_idx in [start, stop)`` of one group (on the node the ticket is sent to)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    group_id: GroupId
    start: NonNegInt
    stop: NonNegInt

    @model_validator(mode="after")
    def _check_range(self) -> SliceRef:
        if self.stop <= self.start:
            msg = f"empty or reversed row range [{self.start}, {self.stop}) for group {self.group_id!r}"
            raise ValueError(msg)
        return self


class SlicesTicket(_Doc):
    """Payload (and any other) columns of the listed slices, streamed in ticket order.

    Example: ``{"v": 3, "kind": "slices", "slices": [{"group_id": "g1", "start": 0, "stop": 4}],
    "columns": ["group_id", "sample_idx", "response_ids"]}``
    """

    kind: Literal["slices"] = "slices"
    slices: list[SliceRef] = Field(min_length=1)
    columns: list[str] | None = None
    """Trajectory columns to return; ``None`` = all."""


class ImagesTicket(_Doc):
    """Image-table rows for the given hex keys, in key order.

    Example: ``{"v": 3, "kind": "images", "keys": ["9f86d0...(64 hex digits)"]}``
    """

    kind: Literal["images"] = "images"
    keys: list[Annotated[str, Field(pattern=f"^[0-9a-f]{{{2 * IMAGE_KEY_BYTES}}}$")]] = Field(min_length=1)
    missing_ok: bool = False
    """Skip keys not stored here instead of refusing (how a client finds which node holds an image)."""


class WeightsTicket(_Doc):
    """The latest weights table (or exactly ``version`` when given).

    Example: ``{"v": 3, "kind": "weights"}``
    """

    kind: Literal["weights"] = "weights"
    version: Version | None = None


Ticket = Annotated[MetadataTicket | SlicesTicket | ImagesTicket | WeightsTicket, Field(discriminator="kind")]


# ---- DoExchange descriptors ----------------------------------------------------------------------


class ReadChannelDescriptor(_Doc):
    """A read channel: one long-lived DoExchange that answers ``slices`` tickets of these ``columns``, one
    request after another, without a call per read.

    The node answers under one schema for the channel's life: the trajectory schema projected to ``columns``
    (all of it for ``None``). The client sends each request as a metadata-only message whose app metadata
    is a ``slices`` ticket of exactly these columns; the node answers with its rows (zero or more batches),
    the last message's app metadata being the JSON end of the answer (see
    :func:`schemas.read_channel.encode_read_end`).

    Example: ``{"v": 3, "kind": "reads", "columns": ["group_id", "sample_idx", "response_ids"]}``
    """

    kind: Literal["reads"] = "reads"
    columns: list[str] | None = None
    """Trajectory columns every answer carries; ``None`` = all."""


# ---- action bodies -----------------------------------------------------------------------------


class ReleaseBody(_Doc):
    """Free the payload of consumed groups. Example: ``{"v": 3, "group_ids": ["g1", "g2"]}``"""

    group_ids: list[GroupId] = Field(min_length=1)


class PublishVersionBody(_Doc):
    """Record the trainer's newest policy version. Example: ``{"v": 3, "version": 5}``"""

    version: Version


MAX_DISPATCHED = 4096
"""Most groups one ``dispatch`` or ``resolve`` body may name."""
ResolveReason = Literal["aborted", "filtered", "cancelled"]
"""Why a group left flight without rows (see :class:`ResolveBody`)."""


class DispatchedGroup(BaseModel):
    """A prompt group the rollout committed to: ``queued`` (drawn from its loader, not yet in the
    engine) or ``running`` (in the engine). ``data_source`` is its quota class; ``prompt_id`` the
    prompt it generates (the same across a re-dispatch after an abort)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    group_id: GroupId
    data_source: Annotated[str, Field(min_length=1, max_length=256)]
    prompt_id: GroupId
    dispatch_version: Version
    state: Literal["queued", "running"] = "running"


class DispatchBody(_Doc):
    """Register (or update) groups in flight on this node; each must belong to it (routing).

    Example: ``{"v": 3, "groups": [{"group_id": "r1-7", "data_source": "math", "prompt_id": "r1-7",
    "dispatch_version": 3, "state": "running"}]}``
    """

    groups: list[DispatchedGroup] = Field(min_length=1, max_length=MAX_DISPATCHED)


class ResolveBody(_Doc):
    """Take groups out of flight without their rows: ``aborted`` (the prompt is dispatched again under a
    new id), ``filtered`` (the rollout discarded it) or ``cancelled`` (never dispatched). A group whose
    rows are written is resolved by that write. Example: ``{"v": 3, "group_ids": ["r1-7"], "reason": "aborted"}``
    """

    group_ids: list[GroupId] = Field(min_length=1, max_length=MAX_DISPATCHED)
    reason: ResolveReason


class DemandBody(_Doc):
    """What the trainer's current train batch still needs and nothing running will bring: groups per
    ``data_source``. The rollout may dispatch prompts of these classes past its lookahead limit (else a
    lookahead full of other classes would wait forever). ``{}`` clears it.
    Example: ``{"v": 3, "classes": {"math": 2}}``
    """

    classes: dict[Annotated[str, Field(min_length=1, max_length=256)], Annotated[int, Field(ge=1, le=1 << 20)]] = \
        Field(max_length=1024)


class SetClusterBody(_Doc):
    """A new cluster view for this node: routing runs over the members not ``down`` (ids), from ``version`` on.
    A node keeps the highest version it was told (an older view changes nothing), so the launcher that watches
    the nodes can tell every node, in any order. Example: ``{"v": 3, "version": 2, "down": ["node1"]}``"""

    version: Annotated[int, Field(ge=1, lt=2**31)]
    down: list[Annotated[str, Field(min_length=1, max_length=512)]] = Field(default_factory=list, max_length=1024)


class EmptyBody(_Doc):
    """Body of ``health`` and ``stats`` (may also be sent empty). Example: ``{"v": 3}``"""


class ListCriteria(_Doc):
    """ListFlights criteria (or empty): up to ``limit`` groups (at most ``groups_per_list``) after ``after``.

    Example: ``{"v": 3, "after": "step3-prompt17", "limit": 500}`` (groups in arrival order)
    """

    after: GroupId | None = None
    limit: Annotated[int, Field(ge=1)] | None = None


def decode_list_criteria(raw: bytes) -> ListCriteria:
    """Parse ListFlights criteria (empty = from the first group)."""
    if not raw:
        return ListCriteria()
    return _validate(ListCriteria, _load_json(raw, "ListFlights criteria", "descriptor_bytes"),  # type: ignore[no-any-return]
                     "ListFlights criteria")


ACTION_BODIES: dict[str, type[_Doc]] = {
    "health": EmptyBody,
    "cluster": EmptyBody,
    "stats": EmptyBody,
    "release": ReleaseBody,
    "publish_version": PublishVersionBody,
    "get_version": EmptyBody,
    "dispatch": DispatchBody,
    "resolve": ResolveBody,
    "demand": DemandBody,
    "inflight": EmptyBody,
    "set_cluster": SetClusterBody,
}
"""Action type -> body model; ``schemas.replies.ACTION_DESCRIPTIONS`` describes the same set."""


# ---- decoding ----------------------------------------------------------------------------------

_DESCRIPTOR = TypeAdapter(Descriptor)
_TICKET = TypeAdapter(Ticket)


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:  # linear: a document of many keys must not cost quadratic time
        if key in out:
            msg = f"duplicate key {key!r}"
            raise ValueError(msg)
        out[key] = value
    return out


def _load_json(raw: bytes, what: str, limit: str) -> Any:
    if len(raw) > LIMITS[limit]:
        msg = f"{what} of {len(raw)} bytes is over the limit {limit}={LIMITS[limit]}"
        raise WireLimitError(msg, limit=limit, value=len(raw))
    try:
        return json.loads(raw, object_pairs_hook=_no_duplicate_keys)
    except (UnicodeDecodeError, ValueError) as exc:
        msg = f"{what} is not valid JSON: {exc}"
        raise WireError(msg) from None


def _validate(adapter: TypeAdapter[Any] | type[BaseModel], doc: Any, what: str) -> Any:
    if not isinstance(doc, dict):
        msg = f"{what} must be a JSON object, got {type(doc).__name__}"
        raise WireError(msg)
    if "v" not in doc:
        msg = f"{what} lacks the schema version field 'v' (this store speaks v={SCHEMA_VERSION})"
        raise WireError(msg)
    for field, limit in _LIST_LIMITS.items():
        value = doc.get(field)
        if isinstance(value, list) and len(value) > LIMITS[limit]:
            msg = f"{what} lists {len(value)} {field}, over the limit {limit}={LIMITS[limit]}"
            raise WireLimitError(msg, limit=limit, value=len(value))
    try:
        if isinstance(adapter, TypeAdapter):
            return adapter.validate_python(doc)
        return adapter.model_validate(doc)
    except ValidationError as exc:
        errs = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '<root>'}: {e['msg']}" for e in exc.errors()[:5]
        )
        msg = f"invalid {what}: {errs}"
        raise WireError(msg) from None


def decode_descriptor(raw: bytes) -> PutGroup | PutGroups | PutImages | PutWeights | GroupRef:
    """Parse a DoPut command descriptor."""
    return _validate(_DESCRIPTOR, _load_json(raw, "descriptor", "descriptor_bytes"), "descriptor")  # type: ignore[no-any-return]


def decode_ticket(raw: bytes) -> MetadataTicket | SlicesTicket | ImagesTicket | WeightsTicket:
    """Parse a DoGet ticket (or a read channel's request)."""
    return _validate(_TICKET, _load_json(raw, "ticket", "ticket_bytes"), "ticket")  # type: ignore[no-any-return]


def decode_exchange(raw: bytes) -> ReadChannelDescriptor:
    """Parse a DoExchange command descriptor (a :class:`ReadChannelDescriptor`, the one kind of exchange)."""
    doc = _load_json(raw, "exchange descriptor", "descriptor_bytes")
    if isinstance(doc, dict) and doc.get("kind") != "reads":
        msg = f"a DoExchange descriptor must be of kind 'reads', got {doc.get('kind')!r}"
        raise WireError(msg)
    return _validate(ReadChannelDescriptor, doc, "exchange descriptor")  # type: ignore[no-any-return]


def decode_action_body(action: str, raw: bytes) -> _Doc:
    """Parse the body of action ``action`` (an empty body is allowed for bodiless actions)."""
    model = ACTION_BODIES.get(action)
    if model is None:
        msg = f"unknown action {action!r}; known: {sorted(ACTION_BODIES)}"
        raise WireError(msg)
    if not raw and model is EmptyBody:
        return EmptyBody()
    what = f"body of action {action!r}"
    return _validate(model, _load_json(raw, what, "action_body_bytes"), what)  # type: ignore[no-any-return]
