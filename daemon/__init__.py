"""The per-node daemon: gRPC server, snapshot stores, erasure coder, failure
detectors and the coordinator. It moves raw bytes and never imports torch.
"""
