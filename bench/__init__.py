"""Benchmarks: each measures Stalwart against a baseline run in the same process.

A benchmark is a module ``stalwart.bench.<name>`` with ``run(quick: bool) -> dict``
returning one JSON-ready object of raw figures and ratios.
"""
