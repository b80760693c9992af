"""The recovery path: who is alive (`registry`, `liveness`, `membership`, `gpu_health`),
who decides (`election`), what is decided (`coordinator`, over `stalwart.core.decide`)
and how a new plan reaches this node's ranks (`plans`, `fencing`).
"""
