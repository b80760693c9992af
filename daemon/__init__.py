"""The per-node daemon: `snapshot/` (capture to committed, erasure-coded state and back),
`recovery/` (liveness, election, coordinator, plans), `rpc/` (thin gRPC servicers),
`security/` (who is calling, what they may do); `server.py` runs them in one process.
It moves raw bytes and never imports torch.
"""
