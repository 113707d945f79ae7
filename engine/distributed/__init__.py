"""Tensor parallelism inside a replica: the ranks' group, the turns rank 0 shares, the weight shards."""
