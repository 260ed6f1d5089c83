"""Paged attention backends behind one interface: a torch reference, Triton kernels, flash-attn."""
