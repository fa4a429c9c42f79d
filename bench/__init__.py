"""Pollen's benchmarks and studies: each script runs as ``python -m bench.<name>`` from the checkout, and
what they share (ledgers, mean ± s.e., the one verdict rule, tables, plots) lives in ``bench.kit``."""
