"""The encoder's self-attention on a CPU in bf16, as two explicit matrix products per slice of
queries with the softmax between them.

torch's CPU SDPA (flash attention) runs the encoder's shape (1500 frames, heads of 64) at about the
same rate in bf16 as in fp32, well under what oneDNN's bf16 products reach on AVX-512 BF16; the
products themselves (scores = Q K^T, then P V) run near that rate. Split into slices of
QUERY_CHUNK queries, the scores of one window's heads stay a few MB, and the buffers are reused
from slice to slice (a fresh multi-MB tensor per slice costs page faults).

The price is precision: a CPU's bf16 product comes out in bf16 (torch has no bf16 x bf16 -> fp32
product there), so the scores are rounded to bf16 before the softmax, which itself runs in fp32
(torch's bf16 softmax accumulates in fp32) and hands bf16 probabilities to the second product, as
SDPA's bf16 path does. tests/engine/transcribe/test_accuracy.py holds the engine's bf16 path to
float32's WER.

With ``scores_dtype=torch.float32`` (engine.cpu_dtype 'bfloat16-products') the scores are a float32
product of float32 copies of Q and K, so the softmax sees them unrounded; only the probabilities
are rounded to bf16 for the second product. A bf16 score near the largest of a row is off by up to
a sixteenth of a unit, which moves its probability by about 6%: the rounding that, accumulated
over the layers, changes transcripts on speech the model is unsure of.
"""

from __future__ import annotations

import torch

# Queries per slice: the scores of one slice are heads x QUERY_CHUNK x frames bf16 values (tiny.en:
# 6 x 384 x 1500, 7 MB). 256 to 512 measured alike; smaller slices add per-call overhead, larger
# ones fall out of cache.
QUERY_CHUNK = 384


def attention_by_products(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scores_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Non-causal attention, q/k/v [N, H, L, D] (any strides, last dim contiguous) -> [N, L, H, D]
    contiguous (the layout the output projection reads), scale 1/sqrt(D). ``scores_dtype``: the
    dtype of the scores and the softmax (default: q's)."""
    batch, heads, frames, head_dim = q.shape
    scores_dtype = scores_dtype or q.dtype
    out = torch.empty(batch, frames, heads, head_dim, dtype=q.dtype, device=q.device)
    # Scaled up front: 1/sqrt(64) is a power of two, so this is exact in bf16 (Whisper's heads are 64).
    scaled_q = q.to(scores_dtype) * head_dim**-0.5
    chunk = min(QUERY_CHUNK, frames)
    scores_buffer = q.new_empty(heads * chunk * frames, dtype=scores_dtype)
    # The probabilities in v's dtype for the second product, where the scores are kept wider.
    probabilities_buffer = q.new_empty(heads * chunk * frames) if scores_dtype != v.dtype else None
    attended_buffer = q.new_empty(heads * chunk * head_dim)
    for window in range(batch):
        # Laid out once per window as the products read them (given strided, each product of a
        # slice would copy its operand again).
        keys_t = k[window].transpose(-1, -2).to(scores_dtype).contiguous()
        values = v[window].contiguous()
        for start in range(0, frames, chunk):
            rows = min(chunk, frames - start)
            scores = scores_buffer[: heads * rows * frames].view(heads, rows, frames)
            torch.matmul(scaled_q[window, :, start : start + rows], keys_t, out=scores)
            torch.softmax(scores, dim=-1, out=scores)  # row by row: safe in place
            if probabilities_buffer is not None:
                scores = probabilities_buffer[: heads * rows * frames].view(heads, rows, frames).copy_(scores)
            attended = attended_buffer[: heads * rows * head_dim].view(heads, rows, head_dim)
            torch.matmul(scores, values, out=attended)
            out[window, start : start + rows] = attended.transpose(0, 1)
    return out
