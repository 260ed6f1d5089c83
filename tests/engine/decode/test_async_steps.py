"""Async steps (``engine.async_steps``): the engine launches each step before reading the tokens of
the step before it, feeding them from the device. Whatever requests ask for and however they end,
they must decode exactly as when each step is read before the next is launched, and every block
must come back to the pool."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import pytest
import torch

from engine.config import EngineConfig
from engine.decode.engine import DecoderEngine
from engine.kv.sources import CrossKVTensor
from engine.model.loading import LoadedModel, load_model
from engine.types import DecodeOptions, DecodeResult, FallbackOptions, FinishReason, Priority
from tests.support.engines import cross_kvs_of, engine_with
from tests.support.speech import SPEECH_DIR, short_english_clips


@dataclass
class Submission:
    at_step: int  # submitted when the engine has run this many steps
    request_id: str
    options: DecodeOptions
    cross_kv: torch.Tensor
    priority: Priority = Priority.INTERACTIVE


def decode_all(
    loaded: LoadedModel,
    submissions: list[Submission],
    async_steps: bool,
    abort: tuple[int, str] | None = None,
    **config,
) -> dict[str, DecodeResult]:
    """Run the submissions to the end; ``abort``: (step, request id) to abort before that step."""
    engine = engine_with(loaded, **{**config, "async_steps": async_steps})
    assert engine.async_steps is async_steps
    results: dict[str, DecodeResult] = {}
    for step in range(5_000):
        for submission in submissions:
            if submission.at_step == step:
                request = engine.make_request(
                    submission.options, CrossKVTensor(submission.cross_kv), request_id=submission.request_id
                )
                request.priority = submission.priority
                engine.submit(request)
        if abort is not None and abort[0] == step:
            engine.abort(abort[1])
        if step > max(s.at_step for s in submissions) and not engine.has_work:
            break
        for result in engine.step():
            assert result.request_id not in results, "a request finished twice"
            results[result.request_id] = result
    assert set(results) == {s.request_id for s in submissions}, "a request never finished"
    assert engine.pool.num_used_blocks == 0
    return results


def assert_same_results(ours: dict[str, DecodeResult], reference: dict[str, DecodeResult]) -> None:
    """Same tokens, text, segments, language, temperature and ending; the float summaries equal up
    to rounding (a step's batch differs by the rows async steps run one step too many)."""
    assert ours.keys() == reference.keys()
    for request_id, result in reference.items():
        mine, theirs = dataclasses.asdict(ours[request_id]), dataclasses.asdict(result)
        for name in ("avg_logprob", "no_speech_prob"):
            a, b = mine.pop(name), theirs.pop(name)
            assert math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-5) or (math.isnan(a) and math.isnan(b)), (
                request_id,
                name,
            )
        for segments in (mine["segments"] or [], theirs["segments"] or []):
            for segment in segments:  # word times come from attention weights: compared to the 20 ms frame
                for word in segment["words"] or []:
                    word["start_s"], word["end_s"] = round(word["start_s"], 2), round(word["end_s"], 2)
        assert mine == theirs, request_id


@pytest.fixture(scope="module")
def clip_kvs(short_clip_cross_kvs) -> list[torch.Tensor]:
    return short_clip_cross_kvs(short_english_clips()[:10])


MIXED_OPTIONS = [
    DecodeOptions(),
    DecodeOptions(timestamps=True, fallback=FallbackOptions()),
    DecodeOptions(timestamps=True, word_timestamps=True),
    DecodeOptions(max_tokens=5),
    DecodeOptions(temperature=0.6, seed=3),
    DecodeOptions(prompt="Earlier words of the same meeting, fed before the window's own prompt."),
    DecodeOptions(timestamps=True, max_tokens=9),
]


@pytest.mark.slow
@pytest.mark.parametrize("stepped_prompt_tokens", [0, 8], ids=["prompt-in-one-step", "prompt-a-token-a-step"])
def test_mixed_requests_joining_mid_decode_end_as_with_each_step_read_before_the_next(
    tiny_en, clip_kvs, stepped_prompt_tokens
):
    submissions = [
        Submission(
            at_step=index // 2 * 3,
            request_id=str(index),
            options=MIXED_OPTIONS[index % len(MIXED_OPTIONS)],
            cross_kv=kv,
        )
        for index, kv in enumerate(clip_kvs)
    ]
    reference = decode_all(
        tiny_en, submissions, async_steps=False, stepped_prompt_tokens=stepped_prompt_tokens
    )
    ours = decode_all(tiny_en, submissions, async_steps=True, stepped_prompt_tokens=stepped_prompt_tokens)
    assert_same_results(ours, reference)
    assert {r.finish_reason for r in ours.values()} == {FinishReason.STOP, FinishReason.LENGTH}
    assert any(r.segments and r.segments[0].words for r in ours.values())


@pytest.mark.slow
def test_beam_windows_joining_and_leaving_mid_decode_end_as_with_each_step_read_first(tiny_en, clip_kvs):
    # The searches whose choices the device makes step as one tail of the batch whose columns are
    # made when its searches change (engine/decode/scheduler/steady_tail.py): here searches join it, end at
    # end of text and by length, and one is aborted, while greedy rows run before it.
    beams = [
        DecodeOptions(beam_size=3),
        DecodeOptions(beam_size=2, timestamps=True),
        DecodeOptions(beam_size=4, max_tokens=6),
        DecodeOptions(),
    ]
    submissions = [
        Submission(at_step=index * 2, request_id=str(index), options=beams[index % len(beams)], cross_kv=kv)
        for index, kv in enumerate(clip_kvs[:8])
    ]
    abort = (14, "0")
    reference = decode_all(tiny_en, submissions, async_steps=False, abort=abort, block_size=16)
    ours = decode_all(tiny_en, submissions, async_steps=True, abort=abort, block_size=16)
    assert_same_results(ours, reference)
    assert ours["0"].finish_reason == FinishReason.ABORTED
    assert {ours[str(index)].finish_reason for index in (2, 6)} == {FinishReason.LENGTH}


@pytest.mark.slow
def test_an_aborted_request_ends_at_once_and_the_others_decode_as_without_async_steps(tiny_en, clip_kvs):
    submissions = [
        Submission(at_step=0, request_id=str(index), options=DecodeOptions(), cross_kv=kv)
        for index, kv in enumerate(clip_kvs[:4])
    ]
    # Aborted mid-decode, while a step launched with it has not been read.
    ours = decode_all(tiny_en, submissions, async_steps=True, abort=(6, "2"))
    reference = decode_all(tiny_en, submissions, async_steps=False, abort=(6, "2"))
    assert ours["2"].finish_reason == FinishReason.ABORTED
    assert_same_results(
        {k: v for k, v in ours.items() if k != "2"}, {k: v for k, v in reference.items() if k != "2"}
    )


@pytest.mark.slow
def test_batch_and_interactive_requests_decoding_side_by_side_end_as_with_each_step_read_first(
    tiny_en, clip_kvs
):
    submissions = [
        Submission(
            at_step=0,
            request_id="batch",
            options=DecodeOptions(),
            cross_kv=clip_kvs[0],
            priority=Priority.BATCH,
        )
    ]
    submissions += [
        Submission(at_step=5, request_id=f"interactive-{i}", options=DecodeOptions(), cross_kv=clip_kvs[i])
        for i in (1, 2)
    ]
    reference = decode_all(tiny_en, submissions, async_steps=False)
    ours = decode_all(tiny_en, submissions, async_steps=True)
    assert_same_results(ours, reference)
    alone = decode_all(tiny_en, submissions[:1], async_steps=True)
    assert ours["batch"].tokens == alone["batch"].tokens


@pytest.mark.slow
def test_a_window_falling_back_to_a_hotter_temperature_samples_as_without_async_steps(tiny_en, clip_kvs):
    """An attempt ending at end of text ran one step more, launched before the host saw the end,
    and that step drew a token from the window's generator; the draw is undone, so the next attempt
    samples the same tokens. (A log-probability threshold of 0 fails every attempt.)"""
    options = DecodeOptions(max_tokens=40, seed=1, fallback=FallbackOptions(logprob_threshold=0.0))
    submissions = [
        Submission(at_step=0, request_id=str(i), options=options, cross_kv=kv)
        for i, kv in enumerate(clip_kvs[:3])
    ]
    reference = decode_all(tiny_en, submissions, async_steps=False)
    ours = decode_all(tiny_en, submissions, async_steps=True)
    assert {result.temperature for result in reference.values()} == {1.0}
    assert_same_results(ours, reference)


@pytest.mark.parametrize("stepped_prompt_tokens", [0, 8], ids=["prompt-in-one-step", "prompt-a-token-a-step"])
def test_the_detected_language_is_fed_from_the_device_as_the_next_prompt_token(
    random_multilingual_whisper_folder, stepped_prompt_tokens
):
    loaded = load_model(
        EngineConfig(
            model=str(random_multilingual_whisper_folder),
            dtype="float32",
            block_size=8,
            kv_cache_memory_mb=64,
        )
    )
    kvs = cross_kvs_of(loaded, [SPEECH_DIR / "jfk.flac", SPEECH_DIR / "jfk.flac"])
    submissions = [
        Submission(at_step=0, request_id="detect", options=DecodeOptions(max_tokens=12), cross_kv=kvs[0]),
        Submission(
            at_step=2,
            request_id="given",
            options=DecodeOptions(language="de", max_tokens=12),
            cross_kv=kvs[1],
        ),
    ]
    reference = decode_all(
        loaded, submissions, async_steps=False, stepped_prompt_tokens=stepped_prompt_tokens
    )
    ours = decode_all(loaded, submissions, async_steps=True, stepped_prompt_tokens=stepped_prompt_tokens)
    assert_same_results(ours, reference)
    assert ours["given"].language == "de" and ours["detect"].language in loaded.tokenizer.language_tokens


def small_gpu_model(folder) -> LoadedModel:
    """The random multilingual model on the GPU in fp32, with 16-token blocks (forks cross block
    boundaries) and room for 8 sequences."""
    return load_model(
        EngineConfig(
            model=str(folder),
            device="cuda",
            dtype="float32",
            block_size=16,
            kv_cache_memory_mb=256,
            max_num_seqs=8,
        )
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_replayed_steps_fed_from_the_device_decode_as_steps_read_in_turn(
    random_multilingual_whisper_folder,
):
    """Where it is on by default: decode steps replayed from CUDA graphs, each fed the tokens of the
    step before from the device, the prompt a token a step, timestamp rules from the device, beam
    choices made on the device (block tables, copies and histories there)."""
    loaded = small_gpu_model(random_multilingual_whisper_folder)
    kvs = cross_kvs_of(loaded, [clip.path for clip in short_english_clips()[:8]])
    options = [
        DecodeOptions(max_tokens=20),
        DecodeOptions(language="en", timestamps=True, max_tokens=24),
        DecodeOptions(language="de", task="translate", max_tokens=16),
        DecodeOptions(max_tokens=30, seed=2, fallback=FallbackOptions(logprob_threshold=0.0)),
        DecodeOptions(language="en", beam_size=3, timestamps=True, max_tokens=40),
    ]
    submissions = [
        Submission(
            at_step=index * 2, request_id=str(index), options=options[index % len(options)], cross_kv=kv
        )
        for index, kv in enumerate(kvs)
    ]
    reference = decode_all(loaded, submissions, async_steps=False)
    ours = decode_all(loaded, submissions, async_steps=True)
    assert_same_results(ours, reference)
    assert DecoderEngine(loaded).runner.graphs is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_beam_choices_replayed_from_cuda_graphs_decode_as_choices_launched_each_step(
    random_multilingual_whisper_folder,
):
    """engine/decode/step/choice_graphs.py: a choice's shape is captured the second time it is seen and
    replayed from then on; the windows decode as they do with the choice's kernels launched at every
    step, and every block comes back."""
    loaded = small_gpu_model(random_multilingual_whisper_folder)
    kvs = cross_kvs_of(loaded, [clip.path for clip in short_english_clips()[:2]])
    options = DecodeOptions(language="en", beam_size=3, timestamps=True, max_tokens=40)

    def decode(replayed: bool) -> tuple[DecoderEngine, dict[str, DecodeResult]]:
        engine = engine_with(loaded, async_steps=True)
        if not replayed:
            engine.pipeline.beam_chooser.graphs = None
        for index, kv in enumerate(kvs):
            engine.submit(engine.make_request(options, CrossKVTensor(kv), request_id=str(index)))
        results = {}
        while engine.has_work:
            results.update((result.request_id, result) for result in engine.step())
        assert engine.pool.num_used_blocks == 0
        return engine, results

    engine, replayed = decode(replayed=True)
    assert engine.pipeline.beam_chooser.graphs.num_captured >= 1
    assert_same_results(replayed, decode(replayed=False)[1])
