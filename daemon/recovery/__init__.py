"""The recovery path: who is alive (`registry`, `liveness`, `membership`, `gossip`,
`gpu_health`), where failures go (`reports`), who leads (`election`), what is decided
and committed (`coordinator`, `step_commits`, over `stalwart.core.decide`), and how a
new plan reaches this node's ranks (`plans`, `fencing`, `announce`).
"""
