"""The training-side library: the DP x PP x TP loop, capture and restore hooks,
the elastic agent. Reaches the daemon only through the stalwart.v1 protocol.
"""
