"""Pure logic shared by the daemon and the client: partitioner, planner,
placement, manifests, cost models. Imports neither grpc, sockets nor
torch.distributed, so everything here is tested in-process.
"""
