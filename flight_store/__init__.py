"""Node-local Arrow Flight store: the store, its Flight server, the clients by role, typed errors, configs.

Imports only pyarrow, polars, pydantic and numpy.
"""

from __future__ import annotations

from flight_store.client import StoreAdmin, StoreNodes
from flight_store.config import ServerConfig, StoreConfig
from flight_store.errors import (
    BudgetExceededError,
    CapacityExceededError,
    ConflictError,
    GroupReleasedError,
    KnitError,
    NodeUnavailableError,
    SchemaMismatchError,
    UnknownGroupError,
    UnknownImageError,
    UnknownWeightsError,
    WireDecodeError,
    WrongNodeError,
)
from flight_store.node import serve
from flight_store.publishing import StorePublisher
from flight_store.reading import StoreReader
from flight_store.server import StoreServer
from flight_store.store import Store
from flight_store.writing import StoreWriter

__all__ = [
    "BudgetExceededError",
    "CapacityExceededError",
    "ConflictError",
    "GroupReleasedError",
    "KnitError",
    "NodeUnavailableError",
    "SchemaMismatchError",
    "ServerConfig",
    "Store",
    "StoreAdmin",
    "StoreConfig",
    "StoreNodes",
    "StorePublisher",
    "StoreReader",
    "StoreServer",
    "StoreWriter",
    "UnknownGroupError",
    "UnknownImageError",
    "UnknownWeightsError",
    "WireDecodeError",
    "WrongNodeError",
    "serve",
]
