"""Whisper in plain torch: the audio encoder, the paged text decoder, the cross-K/V projection.

The encoder is ordinary dense attention over 1500 frames. The decoder never holds K/V itself:
each layer writes its new self-attention K/V into the paged cache and reads self- and
cross-attention K/V back through the attention backend, as named by a DecoderStepMetadata.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.base import AttentionBackend, PagedAttentionBatch
from engine.attention.flash_attention_3 import MIN_WINDOWS, FlashAttention3
from engine.kernels import triton_available
from engine.kernels.fused_norm import add_layer_norm_quantize_rows_op, layer_norm_quantize_rows_op
from engine.kernels.quantize_rows import gelu_quantize_rows_op, quantize_rows_op
from engine.kernels.small_products import FoldedNorm, KVSlots
from engine.kv.storage import PagedKVStorage
from engine.model.bf16_products import ENCODER_LAYER_PRODUCTS, products_in_bf16
from engine.model.cpu_attention import attention_by_products
from engine.model.fp8 import Fp8Linear, quantize_linears
from engine.model.sublayers import SmallRowsSublayers, Sublayers, norm_params
from engine.model.vocabulary import VocabularyProjection
from engine.model.weights import ModelDims


@dataclass
class DecoderStepMetadata:
    """Everything one decoder step needs besides token ids; built once, read by every layer."""

    positions: torch.Tensor  # [T] position of each packed token in its request
    slot_block_ids: torch.Tensor  # [T] block receiving each token's self-attention K/V
    slot_offsets: torch.Tensor  # [T] offset of that slot inside the block
    self_attention: PagedAttentionBatch
    cross_attention: PagedAttentionBatch


class MLP(nn.Module):
    def __init__(self, d_model: int, ffn_dim: int):
        super().__init__()
        self.fc1 = nn.Linear(d_model, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, d_model)
        # The tanh form of GELU, on a GPU in fc1's cuBLASLt epilogue rather than a pass of its own
        # (see AudioEncoder.fuse_gelu); elsewhere, and with FP8 products, the same function unfused.
        self.fused_gelu = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fused_gelu:
            return self.fc2(F.gelu(self.fc1(x)))
        # cuBLASLt's GELU epilogue is the tanh form (torch's CPU kernel is exact); FP8 products have none.
        if x.is_cuda and isinstance(self.fc1, nn.Linear):
            flat = x.reshape(-1, x.shape[-1])
            hidden = torch._addmm_activation(self.fc1.bias, flat, self.fc1.weight.t(), use_gelu=True)
            return self.fc2(hidden).view(*x.shape[:-1], -1)
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class EncoderLayer(nn.Module):
    def __init__(self, d_model: int, num_heads: int, ffn_dim: int):
        super().__init__()
        self.num_heads = num_heads
        self.attn_norm = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.attn_out = nn.Linear(d_model, d_model)
        self.mlp_norm = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model, ffn_dim)
        self.attention_by_products = False  # see AudioEncoder.attend_by_products
        self.attention_scores_dtype: torch.dtype | None = None  # see AudioEncoder.run_products_in_bf16
        self.flash_attention: FlashAttention3 | None = None  # see AudioEncoder.use_flash_attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn_out(self._attend(self.qkv(self.attn_norm(x))))
        return x + self.mlp(self.mlp_norm(x))

    def forward_fp8(self, x: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer with FP8 products on a GPU, whose input is ``x + delta`` (``delta`` None: ``x``):
        each residual add, layer norm and quantization of a product's input is one kernel
        (engine/kernels/fused_norm.py), so the layer's own last add is left to the next layer's
        first kernel. Returns the residual stream and the MLP's output still to add to it."""
        batch, frames, d_model = x.shape
        rows = x.reshape(-1, d_model)
        weight, bias, eps = norm_params(self.attn_norm)
        if delta is None:
            values, scale = layer_norm_quantize_rows_op(rows, weight, bias, eps)
        else:
            rows, values, scale = add_layer_norm_quantize_rows_op(
                rows, delta.reshape(-1, d_model), weight, bias, eps
            )
        attended = self._attend(self.qkv.product(values, scale).view(batch, frames, -1))
        weight, bias, eps = norm_params(self.mlp_norm)
        attention_out = self.attn_out.product(*quantize_rows_op(attended.reshape(-1, d_model)))
        rows, values, scale = add_layer_norm_quantize_rows_op(rows, attention_out, weight, bias, eps)
        hidden = self.mlp.fc1.product(values, scale)
        values, scale = gelu_quantize_rows_op(hidden)
        mlp_out = self.mlp.fc2.product(values, scale)
        return rows.view(batch, frames, d_model), mlp_out.view(batch, frames, d_model)

    def _attend(self, qkv: torch.Tensor) -> torch.Tensor:
        """Self-attention of the QKV projection [N, frames, 3 * d_model] -> [N, frames, d_model]."""
        batch, frames, _ = qkv.shape
        if self.flash_attention is not None and batch >= MIN_WINDOWS:
            q, k, v = qkv.view(batch, frames, 3, self.num_heads, -1).unbind(2)  # [N, frames, H, D]
            return self.flash_attention(q, k, v).view(batch, frames, -1)
        q, k, v = qkv.view(batch, frames, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)  # [N, H, frames, D]
        if self.attention_by_products:
            return attention_by_products(q, k, v, self.attention_scores_dtype).view(batch, frames, -1)
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(batch, frames, -1)


class AudioEncoder(nn.Module):
    def __init__(self, dims: ModelDims):
        super().__init__()
        self.conv1 = nn.Conv1d(dims.n_mels, dims.d_model, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(dims.d_model, dims.d_model, kernel_size=3, stride=2, padding=1)
        self.positions = nn.Parameter(torch.empty(dims.n_audio_ctx, dims.d_model), requires_grad=False)
        self.layers = nn.ModuleList(
            EncoderLayer(dims.d_model, dims.encoder_heads, dims.encoder_ffn_dim)
            for _ in range(dims.encoder_layers)
        )
        self.norm = nn.LayerNorm(dims.d_model)
        self.fp8_kernels = False  # see quantize_fp8

    def fuse_gelu(self) -> None:
        """Each layer's MLP applies its GELU in the first product's epilogue, in the tanh form
        (cuBLASLt has no exact-GELU epilogue). A separate GELU pass reads and writes the whole
        [frames, 4 x d_model] activation, a noticeable share of the encoder's time; fused, the
        encoder runs faster. In bf16 the tanh form's error is under the format's rounding: the
        states' error against an fp32 encoder with the exact GELU is no larger fused than
        unfused. Not for fp32, where it would not be."""
        for layer in self.layers:
            layer.mlp.fused_gelu = True

    def attend_by_products(self) -> None:
        """On a CPU in bf16: each layer's self-attention as explicit bf16 matrix products
        (engine/model/cpu_attention.py), faster there than torch's SDPA."""
        for layer in self.layers:
            layer.attention_by_products = True

    def run_products_in_bf16(self) -> None:
        """On a CPU with bf16 instructions, in a float32 model: each layer's four products and its
        attention's P V product in bf16, its attention scores a float32 product; the convolutions,
        norms and residual stream stay float32 (engine/model/bf16_products.py)."""
        for layer in self.layers:
            products_in_bf16(layer)

    def use_flash_attention(self, build: FlashAttention3, dtype: torch.dtype) -> None:
        """Each layer's self-attention through FlashAttention-3 (engine/attention/flash_attention_3.py)
        in ``dtype``: the model's, or with FP8 products the dtype the QKV product then leaves in."""
        for layer in self.layers:
            layer.flash_attention = build
            if isinstance(layer.qkv, Fp8Linear):
                layer.qkv.leave_in(dtype)

    def quantize_fp8(self) -> None:
        """Every layer's four products (QKV, attention output, the MLP's two) in FP8
        (engine/model/fp8.py); the convolutions, norms and attention stay in 16 bits. The GELU
        takes the tanh form, as the 16-bit encoder's fused epilogue does. On a GPU each layer runs
        through EncoderLayer.forward_fp8, whose kernels fuse every quantization into the pass
        before it; elsewhere each is an operation of its own."""
        for layer in self.layers:
            quantize_linears(layer, list(ENCODER_LAYER_PRODUCTS))
            layer.mlp.fused_gelu = True  # the tanh form
        self.fp8_kernels = self.norm.weight.is_cuda and triton_available()

    def forward(self, mels: torch.Tensor) -> torch.Tensor:
        """mels [N, n_mels, 3000] -> states [N, 1500, d_model], in the encoder's dtype."""
        x = F.gelu(self.conv1(mels.to(self.conv1.weight.dtype)))
        x = F.gelu(self.conv2(x)).transpose(1, 2)
        x = x + self.positions[: x.shape[1]]
        if self.fp8_kernels:
            delta = None
            for layer in self.layers:
                x, delta = layer.forward_fp8(x, delta)
            return self.norm(x + delta)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class DecoderLayer(nn.Module):
    def __init__(self, d_model: int, num_heads: int, ffn_dim: int):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        self.self_attn_norm = nn.LayerNorm(d_model)
        self.self_qkv = nn.Linear(d_model, 3 * d_model)
        self.self_out = nn.Linear(d_model, d_model)
        self.cross_attn_norm = nn.LayerNorm(d_model)
        self.cross_q = nn.Linear(d_model, d_model)
        self.cross_out = nn.Linear(d_model, d_model)
        self.mlp_norm = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model, ffn_dim)

    def norms_before_products(self) -> tuple[tuple[nn.LayerNorm, nn.Linear], ...]:
        """Each layer norm and the product of its output."""
        return (
            (self.self_attn_norm, self.self_qkv),
            (self.cross_attn_norm, self.cross_q),
            (self.mlp_norm, self.mlp.fc1),
        )

    def forward(
        self,
        x: torch.Tensor,
        pending: torch.Tensor,
        layer_cache: torch.Tensor,
        meta: DecoderStepMetadata,
        backend: AttentionBackend,
        sublayers: Sublayers | SmallRowsSublayers,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer on the residual stream ``x`` plus ``pending``, the previous sublayer's output
        not yet added (so that the add and this layer's first norm fuse). Returns the stream and
        this layer's MLP output, again pending.

        layer_cache: this layer's K/V, [num_blocks, 2 (k|v), block_size, H, D] (a strided view)."""
        tokens, d_model = x.shape
        heads = (tokens, self.num_heads, self.head_dim)
        scale = self.head_dim**-0.5
        add_norm_product, product = sublayers.add_norm_product, sublayers.product
        slots = KVSlots(layer_cache, meta.slot_block_ids, meta.slot_offsets)
        x, q = add_norm_product(x, pending, self.self_attn_norm, self.self_qkv, slots=slots)
        key_cache, value_cache = layer_cache[:, 0], layer_cache[:, 1]
        attended = backend.paged_attention(q.view(heads), key_cache, value_cache, meta.self_attention, scale)
        attention_out = product(attended.reshape(tokens, d_model), self.self_out)

        x, q = add_norm_product(x, attention_out, self.cross_attn_norm, self.cross_q)
        attended = backend.paged_attention(q.view(heads), key_cache, value_cache, meta.cross_attention, scale)
        attention_out = product(attended.reshape(tokens, d_model), self.cross_out)
        x, hidden = add_norm_product(x, attention_out, self.mlp_norm, self.mlp.fc1, gelu=True)
        return x, product(hidden, self.mlp.fc2)


class TextDecoder(nn.Module):
    def __init__(self, dims: ModelDims):
        super().__init__()
        self.dims = dims
        # Given a weight, the table skips its random init, whose meta-device form imports torch._dynamo.
        weight = torch.empty(dims.vocab_size, dims.d_model)
        self.embed_tokens = nn.Embedding(dims.vocab_size, dims.d_model, _weight=weight)
        self.positions = nn.Parameter(torch.empty(dims.n_text_ctx, dims.d_model), requires_grad=False)
        self.layers = nn.ModuleList(
            DecoderLayer(dims.d_model, dims.decoder_heads, dims.decoder_ffn_dim)
            for _ in range(dims.decoder_layers)
        )
        self.norm = nn.LayerNorm(dims.d_model)
        # Every layer's cross-attention K and V projection as one matrix, applied once per request
        # to the encoder states: one large matrix product instead of one per layer, and its
        # output viewed (not copied) into the per-layer layout.
        self.cross_kv = nn.Linear(dims.d_model, dims.decoder_layers * 2 * dims.d_model)
        self.sublayers = Sublayers()
        self.small_rows_products = 0  # see use_small_rows_products
        self.folded_norms: dict[nn.Linear, FoldedNorm] = {}
        self.vocabulary = VocabularyProjection(self.embed_tokens)  # the output projection, tied
        self.cross_kv_in_bf16 = False  # see project_cross_kv_in_bf16

    def fuse_residual_norms(self) -> None:
        """Run each residual add and the layer norm after it as one Triton kernel (CUDA)."""
        from engine.kernels.fused_norm import triton_add_layer_norm

        self.sublayers = Sublayers(add_norm=triton_add_layer_norm)

    def use_small_rows_products(self, max_rows: int) -> None:
        """Steps of at most ``max_rows`` tokens (a decode step's few sequences) run their products
        through a Triton kernel that loads its weights while the kernel before it runs, the QKV
        product's storing its keys and values itself, and the products after a layer norm taking the
        residual add and the norm into their kernel at one row (SmallRowsSublayers); with 0, none
        does. Set once the weights are final, before the decode graphs capture the step."""
        self.small_rows_products = max_rows
        pairs = [pair for layer in self.layers for pair in layer.norms_before_products()] if max_rows else []
        self.folded_norms = {linear: FoldedNorm.of(norm, linear) for norm, linear in pairs}

    def forward(
        self,
        token_ids: torch.Tensor,
        meta: DecoderStepMetadata,
        storage: PagedKVStorage,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """Packed token ids [T] -> final hidden states [T, d_model]; writes their K/V to the cache."""
        sublayers = self.sublayers
        if token_ids.shape[0] <= self.small_rows_products:
            sublayers = SmallRowsSublayers(otherwise=self.sublayers, folded=self.folded_norms)
        x, pending = self.embed_tokens(token_ids), self.positions[meta.positions]
        for index, layer in enumerate(self.layers):
            x, pending = layer(x, pending, storage.layer_cache(index), meta, backend, sublayers)
        return sublayers.add_norm(x, pending, *norm_params(self.norm))[1]

    def store_widening_weights_column_major(self) -> None:
        """On a CPU: the products that widen the stream (QKV, the MLP's first) keep their weights
        column-major, [in, out] contiguous. At a decode step's few rows the float32 product is a
        matrix-vector product, which MKL runs on one core over the row-major [out, in] layout and
        markedly faster over this one. The same weights and the same function; only the memory
        order changes (nn.Linear reads either)."""
        for layer in self.layers:
            for linear in (layer.self_qkv, layer.mlp.fc1):
                column_major = linear.weight.detach().t().contiguous().t()
                linear.weight = nn.Parameter(column_major, requires_grad=False)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits of the final hidden states (engine/model/vocabulary.py)."""
        return self.vocabulary.logits(hidden)

    def keep_only_cross_kv(self) -> None:
        """Free every decoder weight but the cross-K/V projection: all an encoder replica uses of
        the decoder (for large-v3, 1.6 of its 1.8 GB)."""
        self.layers = self.embed_tokens = self.norm = self.positions = self.vocabulary = None

    def project_cross_kv_in_bf16(self) -> None:
        """On a CPU with bf16 instructions: the cross-K/V projection's weights in bf16. Its input,
        the bf16 encoder's states, is already bf16-exact, so the product over 1500 frames loses
        nothing to bf16 weights and runs on the bf16 instructions as the encoder's products do."""
        self.cross_kv.to(torch.bfloat16)
        self.cross_kv_in_bf16 = True

    def project_cross_kv(self, states: torch.Tensor) -> torch.Tensor:
        """Encoder states [N, frames, d] -> cross-attention K/V [N, *dims.cross_kv_shape] (a strided
        view of one [N, frames, layers * 2 * d] product), in the projection's dtype (the caller casts
        to the KV cache's)."""
        batch, frames, _ = states.shape
        dims = self.dims
        if self.cross_kv_in_bf16:
            states = states.to(torch.bfloat16)
        kv = self.cross_kv(states).view(
            batch, frames, dims.decoder_layers, 2, dims.decoder_heads, dims.head_dim
        )
        return kv.permute(0, 2, 3, 1, 4, 5)


class Whisper(nn.Module):
    def __init__(self, dims: ModelDims):
        super().__init__()
        self.dims = dims
        self.encoder = AudioEncoder(dims)
        self.decoder = TextDecoder(dims)

    def load_canonical_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load Hugging Face-named, unfused weights (engine.model.weights' canonical form), fusing them."""
        sd = state_dict
        dims = self.dims

        def fused(prefix: str, parts: str) -> tuple[torch.Tensor, torch.Tensor]:
            weights = [sd[f"{prefix}.{p}_proj.weight"] for p in parts]
            # Whisper's key projection has no bias; a zero bias keeps the fused matmul exact.
            biases = [
                sd.get(f"{prefix}.{p}_proj.bias", torch.zeros(weights[0].shape[0], device=weights[0].device))
                for p in parts
            ]
            return torch.cat(weights), torch.cat([b.to(weights[0].dtype) for b in biases])

        mine: dict[str, torch.Tensor] = {
            "encoder.conv1.weight": sd["encoder.conv1.weight"],
            "encoder.conv1.bias": sd["encoder.conv1.bias"],
            "encoder.conv2.weight": sd["encoder.conv2.weight"],
            "encoder.conv2.bias": sd["encoder.conv2.bias"],
            "encoder.positions": sd["encoder.embed_positions.weight"],
            "encoder.norm.weight": sd["encoder.layer_norm.weight"],
            "encoder.norm.bias": sd["encoder.layer_norm.bias"],
            "decoder.embed_tokens.weight": sd["decoder.embed_tokens.weight"],
            "decoder.positions": sd["decoder.embed_positions.weight"],
            "decoder.norm.weight": sd["decoder.layer_norm.weight"],
            "decoder.norm.bias": sd["decoder.layer_norm.bias"],
        }
        cross_kv = [fused(f"decoder.layers.{i}.encoder_attn", "kv") for i in range(dims.decoder_layers)]
        mine["decoder.cross_kv.weight"] = torch.cat([weight for weight, _ in cross_kv])
        mine["decoder.cross_kv.bias"] = torch.cat([bias for _, bias in cross_kv])

        def common(side: str, i: int, attn_norm: str, qkv: str, out: str) -> None:
            src, dst = f"{side}.layers.{i}", f"{side}.layers.{i}"
            for suffix in ("weight", "bias"):
                mine[f"{dst}.{attn_norm}.{suffix}"] = sd[f"{src}.self_attn_layer_norm.{suffix}"]
                mine[f"{dst}.{out}.{suffix}"] = sd[f"{src}.self_attn.out_proj.{suffix}"]
                mine[f"{dst}.mlp_norm.{suffix}"] = sd[f"{src}.final_layer_norm.{suffix}"]
                mine[f"{dst}.mlp.fc1.{suffix}"] = sd[f"{src}.fc1.{suffix}"]
                mine[f"{dst}.mlp.fc2.{suffix}"] = sd[f"{src}.fc2.{suffix}"]
            mine[f"{dst}.{qkv}.weight"], mine[f"{dst}.{qkv}.bias"] = fused(f"{src}.self_attn", "qkv")

        for i in range(dims.encoder_layers):
            common("encoder", i, "attn_norm", "qkv", "attn_out")
        for i in range(dims.decoder_layers):
            common("decoder", i, "self_attn_norm", "self_qkv", "self_out")
            src = f"decoder.layers.{i}"
            for suffix in ("weight", "bias"):
                mine[f"{src}.cross_attn_norm.{suffix}"] = sd[f"{src}.encoder_attn_layer_norm.{suffix}"]
                mine[f"{src}.cross_q.{suffix}"] = sd[f"{src}.encoder_attn.q_proj.{suffix}"]
                mine[f"{src}.cross_out.{suffix}"] = sd[f"{src}.encoder_attn.out_proj.{suffix}"]

        own = self.state_dict()
        for name, tensor in mine.items():
            if own[name].shape != tensor.shape:
                raise ValueError(
                    f"weight {name}: shape {tuple(tensor.shape)}, model expects {tuple(own[name].shape)}"
                )
        self.load_state_dict({k: v.to(own[k].dtype) for k, v in mine.items()}, strict=True)
