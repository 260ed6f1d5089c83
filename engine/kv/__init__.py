"""KV memory: the block pool (ids only), the paged tensors, device block tables, cross-K/V sources."""
