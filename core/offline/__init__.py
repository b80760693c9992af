"""Offline planning tools, never imported by the daemon or by training: the strategy
advisor, the communication model and `stalwart plan`. They build on the runtime's pure
logic (costs, partitioner, placement), never the other way round.
"""
