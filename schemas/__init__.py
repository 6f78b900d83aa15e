"""Schemas of the knittrans data plane: Arrow tables, wire documents, plans, records.

Imports with pyarrow, polars and pydantic alone.
"""

from schemas.arrow import (
    IMAGE_KEY_BYTES,
    IMAGE_SCHEMA,
    METADATA_COLUMNS,
    METADATA_SCHEMA,
    PAYLOAD_COLUMNS,
    SCHEMA_VERSION,
    STATUSES,
    TRAJECTORY_SCHEMA,
)
from schemas.plan import MicroBatch, MiniBatchPlan, PlannedSlice, RankPlan
from schemas.records import TrajectoryRecord, records_to_batch

__all__ = [
    "IMAGE_KEY_BYTES",
    "IMAGE_SCHEMA",
    "METADATA_COLUMNS",
    "METADATA_SCHEMA",
    "PAYLOAD_COLUMNS",
    "SCHEMA_VERSION",
    "STATUSES",
    "TRAJECTORY_SCHEMA",
    "MicroBatch",
    "MiniBatchPlan",
    "PlannedSlice",
    "RankPlan",
    "TrajectoryRecord",
    "records_to_batch",
]
