"""The chaos run: ``knit run`` on namespace hosts under faults that come together (``python -m bench.chaos``)."""
