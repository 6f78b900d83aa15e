"""``python -m launcher ...`` = ``knit ...``."""

from __future__ import annotations

from launcher.cli import main

raise SystemExit(main())
