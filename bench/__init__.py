"""The benches: speed is measured here, never asserted in tests. Each is run as
``python -m bench.<name>`` (``--quick``: the smallest run, which CI makes so none rots), writes
JSON to bench/results/, prints a table and draws a plot. What they share is bench/lib/."""
