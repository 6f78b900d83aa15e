"""``torchrun --nproc_per_node N -m train --stores ...`` (or ``python -m train --nproc N ...``)."""

from __future__ import annotations

from train.entry import main

if __name__ == "__main__":
    raise SystemExit(main())
