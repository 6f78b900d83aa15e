"""The native passes over trajectory batches (schemas/_kernels.c); see there and :mod:`schemas.native`."""

from typing import Any

import numpy as np

_Bytes = bytes | memoryview | np.ndarray

def signature(schema_capsule: Any, fields: bool = False, /) -> bytes: ...
def check_group_batch(schema_capsule: Any, array_capsule: Any, signature: _Bytes, fields_signature: _Bytes,
                      group_id: bytes, statuses: bytes, table: _Bytes, out_bytes: np.ndarray, /) -> int: ...
def row_bytes(schema_capsule: Any, array_capsule: Any, signature: _Bytes, layout: _Bytes, out: np.ndarray,
              /) -> None: ...
