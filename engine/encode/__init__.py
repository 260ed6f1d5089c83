"""The encoder side: 30 s windows -> encoder states -> cross-attention K/V, on its own CUDA stream."""
