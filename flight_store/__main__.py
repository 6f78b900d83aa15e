"""``python -m flight_store ...`` = ``knit ...``."""

from __future__ import annotations

from flight_store.cli import main

raise SystemExit(main())
