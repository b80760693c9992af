"""Stalwart keeps large-model training alive through hardware failure.

Namespaces: ``stalwart.client`` (training side), ``stalwart.daemon`` (per-node
daemon), ``stalwart.core`` (pure logic shared by both), ``stalwart.v1``
(generated protocol code), ``stalwart.bench`` (benchmarks).
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
