"""On a CUDA GPU: the engine as it runs there (Triton paged attention, decode steps replayed from
CUDA graphs, continuous batching) greedy-decodes exactly transformers' tokens for random weights
of the large-v3 and large-v3-turbo shapes, in fp32. In fp16 and bf16 the two differ by rounding
(different kernels sum in different orders), so those are held to the first token.

These run where CUDA is (the lent GPU machine: see benchmarks/RESULTS.md); without a GPU they skip.
"""

from __future__ import annotations

import threading

import pytest
import torch

from engine.config import EngineConfig
from engine.decode.engine import DecoderEngine
from engine.decode.step import cuda_graphs
from engine.encode.overlap import OverlappedEncoder
from engine.encode.runner import EncoderRunner
from engine.kv.sources import CrossKVTensor
from engine.model.audio import N_SAMPLES, log_mel_spectrogram
from engine.model.fp8 import fp8_supported
from engine.types import DecodeOptions
from tests.support.engines import run_to_completion_by_id
from tests.support.gpu_models import engine_model, random_hf_whisper
from tests.support.hf_reference import hf_greedy_as_engine
from tests.support.models import bundled_tokenizer
from tests.support.speech import short_english_clips, windows_of

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

NUM_WINDOWS = 8
NEW_TOKENS = 30


def decode_both(shape: str, dtype: torch.dtype, language: str | None = "en"):
    hf = random_hf_whisper(shape, "cuda", dtype)
    loaded = engine_model(
        hf,
        bundled_tokenizer("base"),
        EngineConfig(
            model=shape,
            device="cuda",
            dtype=str(dtype).removeprefix("torch."),
            attention_backend="triton",
            max_num_seqs=NUM_WINDOWS,
            kv_cache_memory_mb=NUM_WINDOWS * 350 if shape == "large-v3" else NUM_WINDOWS * 50,
        ),
    )
    engine, encoder = DecoderEngine(loaded), EncoderRunner(loaded)
    assert engine.runner.graphs is not None
    audio = windows_of([clip.path for clip in short_english_clips()[:NUM_WINDOWS]]).cuda()
    cross_kv = encoder.cross_kv(encoder.encode(audio))
    requests = [
        engine.make_request(DecodeOptions(language=language, max_tokens=NEW_TOKENS), CrossKVTensor(kv))
        for kv in cross_kv
    ]
    for request in requests:
        engine.submit(request)
    results = run_to_completion_by_id(engine)
    assert engine.pool.num_used_blocks == 0
    ours = [results[r.request_id].tokens for r in requests]
    mels = log_mel_spectrogram(audio, loaded.weights.dims.n_mels).to(dtype)
    if (
        language is None
    ):  # each request's detected language is transformers' likeliest at <|startoftranscript|>
        tokenizer = loaded.tokenizer
        codes = list(tokenizer.language_tokens)
        language_ids = torch.tensor([tokenizer.language_tokens[c] for c in codes], device="cuda")
        with torch.inference_mode():
            sot_logits = hf(
                input_features=mels,
                decoder_input_ids=torch.full((NUM_WINDOWS, 1), tokenizer.special.sot, device="cuda"),
            ).logits[:, -1]
        assert [results[r.request_id].language for r in requests] == [
            codes[i] for i in sot_logits[:, language_ids].argmax(dim=-1).tolist()
        ]
    theirs = [
        hf_greedy_as_engine(hf, mels[i : i + 1], engine, requests[i], max_new_tokens=NEW_TOKENS)
        for i in range(NUM_WINDOWS)
    ]
    return ours, theirs, engine.runner.graphs.replays


@pytest.mark.parametrize("shape", ["large-v3", "large-v3-turbo"])
def test_fp32_greedy_tokens_equal_transformers_on_the_gpu(shape):
    ours, theirs, _ = decode_both(shape, torch.float32)
    assert all(len(tokens) > 0 for tokens in ours)
    assert ours == theirs


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_first_tokens_equal_transformers_on_the_gpu(dtype):
    ours, theirs, _ = decode_both("large-v3-turbo", dtype)
    first_equal = sum(a[:1] == b[:1] for a, b in zip(ours, theirs))
    assert first_equal >= NUM_WINDOWS - 1, (ours, theirs)


def test_fp32_language_detection_in_replayed_steps_equals_transformers():
    """The prompt runs a token a step through the captured graphs; the logits at
    <|startoftranscript|> come from a replayed step and pick transformers' language."""
    ours, theirs, _ = decode_both("large-v3-turbo", torch.float32, language=None)
    assert ours == theirs


def test_fp32_greedy_tokens_equal_transformers_across_the_short_text_graphs(monkeypatch):
    """Steps whose texts are all short replay graphs whose self-attention is sized for short texts
    (engine/decode/step/cuda_graphs.py). With that length at 8 tokens, every window's decode crosses from
    those graphs to the ones sized for the whole context, and the tokens stay transformers'."""
    monkeypatch.setattr(cuda_graphs, "SHORT_TEXT_KEYS", 8)
    ours, theirs, replays = decode_both("large-v3-turbo", torch.float32)
    assert ours == theirs
    text_lengths = {length for _, length in replays}
    assert text_lengths == {8, 448}, replays


def turbo_with_encoder_graphs(fp8_encoder: bool = False, **config):
    """Random fp16 weights of the large-v3-turbo shape, with engine.gpu.encoder_cuda_graphs on (with
    the FP8 encoder, as it resolves by default); skips the test where the GPU has no FP8 tensor cores."""
    if fp8_encoder and not fp8_supported(torch.device("cuda")):
        pytest.skip("FP8 tensor cores needed")
    hf = random_hf_whisper("large-v3-turbo", "cuda", torch.float16)
    gpu = {"fp8_encoder": True} if fp8_encoder else {"encoder_cuda_graphs": True}
    settings = EngineConfig(model="large-v3-turbo", device="cuda", dtype="float16", gpu=gpu, **config)
    return engine_model(hf, bundled_tokenizer("base"), settings)


@pytest.mark.parametrize("fp8_encoder", [False, True], ids=["fp16", "fp8"])
def test_the_encoders_cuda_graphs_give_its_compiled_forwards_states(fp8_encoder):
    """Batches replayed from a bucket's graph (3 windows in the bucket of 4, 8 in 8's) and one
    larger than any bucket (run without) give the states the compiled encoder gives on its own."""
    loaded = turbo_with_encoder_graphs(fp8_encoder, kv_cache_memory_mb=256)
    plain, graphed = EncoderRunner(loaded), EncoderRunner(loaded, graph_batch_size=8)
    assert plain.graphs is None and graphed.graphs is not None and graphed.graphs.sizes == [1, 2, 4, 8]
    audio = windows_of([clip.path for clip in short_english_clips()[:9]]).cuda()
    for count in (3, 8, 9, 1):
        expected, states = plain.encode(audio[:count]), graphed.encode(audio[:count])
        assert states.shape == expected.shape
        torch.testing.assert_close(states, expected, atol=2e-2, rtol=2e-2)
    first = graphed.encode(audio[:2])
    graphed.encode(audio[2:4])  # a later replay of the same bucket must not change what was handed out
    torch.testing.assert_close(first, plain.encode(audio[:2]), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("fp8_encoder", [False, True], ids=["fp16", "fp8"])
def test_the_encoders_graphs_replay_beside_the_decode_steps_graphs_and_both_finish(fp8_encoder):
    """The colocated layout: encoder batches replayed from their graphs on the encoder's stream while
    decode steps replay theirs on the decode loop's. Captured on torch's one default capture stream,
    both sets of graphs shared a cuBLAS workspace, and replaying them at once hung the GPU
    (engine/encode/graphs.py); the two threads here must both finish, with the FP8 encoder's
    products (cuBLASLt) too."""
    loaded = turbo_with_encoder_graphs(fp8_encoder, max_num_seqs=64, kv_cache_memory_mb=64 * 50)
    engine = DecoderEngine(loaded)
    encoder = OverlappedEncoder(EncoderRunner(loaded, graph_batch_size=32), project_cross_kv=True)
    assert engine.runner.graphs is not None and encoder.runner.graphs is not None
    # engine.gpu.encoder_stream_first (on by default): the encoder's forwards outrank the decode steps.
    assert encoder.stream.priority < torch.cuda.current_stream().priority
    audio = torch.randn(32, N_SAMPLES, generator=torch.Generator().manual_seed(0)) * 0.1
    cross_kv = encoder.encode_blocking(audio[:1])[0]
    options = DecodeOptions(language="en", max_tokens=100, ignore_eot=True)
    for _ in range(64):
        engine.submit(engine.make_request(options, CrossKVTensor(cross_kv)))
    done: list[str] = []

    def encode_batches() -> None:
        for _ in range(10):
            encoder.encode_blocking(audio)
        done.append("encoder")

    def decode_all() -> None:
        while engine.has_work:
            engine.step()
        done.append("decoder")

    threads = [threading.Thread(target=work, daemon=True) for work in (decode_all, encode_batches)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=180)
    assert sorted(done) == ["decoder", "encoder"], f"finished: {done}; the rest did not within 180 s"
    assert engine.pool.num_used_blocks == 0


def test_an_encoder_on_a_share_of_the_sms_gives_the_full_gpus_states_on_a_stream_of_its_own():
    """engine.gpu.encoder_sm_share: the encoder's stream belongs to a green context holding that
    share of the SMs; the same compiled kernels on fewer SMs give the same states."""
    hf = random_hf_whisper("large-v3-turbo", "cuda", torch.float16)
    settings = EngineConfig(
        model="large-v3-turbo", device="cuda", dtype="float16", gpu={"encoder_sm_share": 0.5}
    )
    loaded = engine_model(hf, bundled_tokenizer("base"), settings)
    runner = EncoderRunner(loaded)
    assert runner.sm_share == 0.5
    partitioned = OverlappedEncoder(runner, project_cross_kv=False)
    assert partitioned.stream is not None and partitioned.stream != torch.cuda.current_stream()
    audio = windows_of([clip.path for clip in short_english_clips()[:4]])
    try:
        states = partitioned.encode_blocking(audio)
    finally:
        partitioned.close()
    torch.testing.assert_close(states, runner.encode(audio), atol=2e-2, rtol=2e-2)


def test_windows_through_the_page_locked_buffer_on_the_encoders_stream_give_the_stacked_batchs_states():
    """engine/encode/staging.py on a GPU: each batch's rows copied to the device without the thread
    waiting, on the encoder's own stream; the next batch reuses the rows once that copy is done."""
    hf = random_hf_whisper("large-v3-turbo", "cuda", torch.float16)
    loaded = engine_model(hf, bundled_tokenizer("base"), EngineConfig(model="large-v3-turbo", device="cuda"))
    runner = EncoderRunner(loaded, graph_batch_size=2)
    encoder = OverlappedEncoder(runner, project_cross_kv=False)
    audio = windows_of([clip.path for clip in short_english_clips()[:5]])
    batches = [
        [row[: 16000 * (3 + index)].numpy() for index, row in enumerate(audio[:4])],
        [audio[4].numpy()],
    ]
    try:
        staged = [encoder.encode_blocking(batch) for batch in batches]  # 4 rows grows the 2-row buffer
        assert runner.staging.page_locked
        stacked = [encoder.encode_blocking(windows_of(batch)) for batch in batches]
    finally:
        encoder.close()
    for ours, expected in zip(staged, stacked):
        torch.testing.assert_close(ours, expected, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_the_gpu_the_vocabulary_is_padded_to_aligned_rows_and_gives_the_unpadded_logits(dtype):
    hf = random_hf_whisper("large-v3-turbo", "cuda", dtype)
    loaded = engine_model(
        hf,
        bundled_tokenizer("base"),
        EngineConfig(model="large-v3-turbo", device="cuda", dtype=str(dtype).removeprefix("torch.")),
    )
    decoder = loaded.model.decoder
    vocabulary = decoder.vocabulary
    weight = decoder.embed_tokens.weight
    assert vocabulary.padded.shape[0] % 64 == 0 and vocabulary.padded.shape[0] > weight.shape[0]
    assert weight.data_ptr() == vocabulary.padded.data_ptr()  # one copy: the embedding is a view
    torch.testing.assert_close(weight, hf.model.decoder.embed_tokens.weight, rtol=0, atol=0)
    hidden = torch.randn(37, weight.shape[1], device="cuda", dtype=dtype)
    logits = decoder.logits(hidden)
    assert logits.shape == (37, weight.shape[0]) and logits.dtype == torch.float32 and logits.is_contiguous()
    expected = hidden.float() @ weight.float().T
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-3)
