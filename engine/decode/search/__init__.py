"""Decoding a window as several hypotheses: one interface (``Search``), beam search and best-of
samples behind it."""
