"""Pure logic shared by the daemon and the client: partitioner, planner,
placement, manifests, cost models. Imports neither grpc, sockets nor
torch.distributed, so everything here is tested in-process. The offline planning
tools built on it (advisor, communication model, `stalwart plan`) are in offline/.
"""
