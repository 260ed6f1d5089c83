"""The decoder's output projection, tied to the token embedding: float32 logits of the final hidden
states, computed on each device the fastest way that keeps what a choice of token needs."""

from __future__ import annotations

import torch
from torch import nn

# With engine.cpu_dtype bfloat16, each row's likeliest tokens by the bf16 vocabulary projection whose
# logits are recomputed in float32: enough that the refined projection alone leaves every speech-set
# transcript (tiny.en) as float32's, few enough to cost little beside the projection.
REFINED_TOKENS = 64


class VocabularyProjection:
    """Logits through the embedding's weights [vocab, d_model] (read at each call: loading replaces
    them), as they are, or by one of two layouts made at load time for a device."""

    def __init__(self, embedding: nn.Embedding):
        self.embedding = embedding
        self.bf16: torch.Tensor | None = None  # see keep_bf16_copy
        self.padded: torch.Tensor | None = None  # see pad_rows

    def keep_bf16_copy(self) -> None:
        """On a CPU with bf16 instructions: the weights also in bf16, read first (engine.cpu_dtype).
        At a few decode rows the projection is a pass over the whole matrix, bound by memory
        bandwidth, and half the bytes take half the time."""
        self.bf16 = self.embedding.weight.detach().to(torch.bfloat16)

    def pad_rows(self, multiple: int = 64) -> None:
        """On a GPU: the weights in a buffer of rows padded to a multiple of ``multiple`` (zeros),
        the embedding a view of its first ``vocab`` rows (one copy of the weights). Whisper's
        vocabularies (51864-51866 tokens) leave the product's float32 output rows misaligned, and
        cuBLAS then picks markedly slower kernels at a decode step's row counts. The padded columns
        are dropped from the logits."""
        vocab, width = self.embedding.weight.shape
        rows = -(-vocab // multiple) * multiple
        if rows == vocab:
            return
        padded = self.embedding.weight.new_zeros(rows, width)
        padded[:vocab] = self.embedding.weight.detach()
        self.embedding.weight = nn.Parameter(padded[:vocab], requires_grad=False)
        self.padded = padded

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits of ``hidden`` [rows, d_model]. In half precision the product still
        accumulates in fp32 and comes out in fp32: rounded to bf16 (or fp16), logits near 20 move
        in steps of 0.125, enough to swap the top two tokens of an unsure step."""
        weight = self.embedding.weight
        if hidden.dtype == torch.float32 and self.bf16 is not None:
            return self._refined(hidden, weight)
        if self.padded is not None:  # a GPU's: the product over aligned rows
            if hidden.dtype == torch.float32:
                padded = hidden @ self.padded.T
            else:
                padded = torch.mm(hidden, self.padded.T, out_dtype=torch.float32)
            return padded[:, : weight.shape[0]].contiguous()
        if hidden.dtype == torch.float32:
            return hidden @ weight.T
        if hidden.is_cuda:
            return torch.mm(hidden, weight.T, out_dtype=torch.float32)
        return hidden.float() @ weight.float().T  # CPUs have no mixed-dtype product

    def _refined(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """bf16 logits (a CPU's bf16 product comes out rounded to bf16), then the likeliest
        REFINED_TOKENS of each row recomputed in float32: the tokens a choice is made among get
        exact logits, and the rest keep an error too small to move a log-probability much."""
        logits = (hidden.to(torch.bfloat16) @ self.bf16.T).float()
        likeliest = logits.topk(REFINED_TOKENS, dim=-1).indices  # [rows, k]
        exact = torch.einsum("rd,rkd->rk", hidden, weight[likeliest])
        return logits.scatter_(1, likeliest, exact)
