"""The snapshot path, one file per stage: a rank's capture lands in a slot (`intake`),
is delta-encoded into chunks (`chunks`, `codecs`), erasure-coded and placed on
peers and S3 (`coder`, `place`), kept on this node (`local_store`, `shard_store`),
committed (`commit`) and read back (`restore`, `shard_reader`).
"""
