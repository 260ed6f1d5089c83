"""GPU speed, ours vs transformers in one run, on random weights of the real shapes
(large-v3, large-v3-turbo; the engine's dtype, --dtype; 100 output tokens per request, end of text ignored).

(a) encoder windows/s at batch 1, 8, 32, 64 (ours: log-mel + encoder from raw samples;
    transformers: encoder from the same log-mel, so its CPU feature extractor does not count);
(b) decode ms per step at batch 1, 16, 64, 128: ours (CUDA-graph replay, and the whole engine
    step with sampling, also with timestamps on, and with each step read before the next is
    launched: async steps off) vs transformers' static-batch generate, beside the memory-bandwidth
    bound (bytes one step must read / the GPU's peak bandwidth);
(c) engine throughput, requests/s: a Poisson stream of 30 s windows; ours encodes arrived windows
    in batches and decodes them with continuous batching on the same GPU, the encoder on its own
    stream (also: encoder inline, and an fp8 K/V cache holding twice the requests in the same
    memory, and async steps off); transformers takes arrived requests in static batches of up to 64
    (encoder + generate);
(light) latency under a light Poisson load (ours also with each prompt fed in one eager step:
    engine.gpu.stepped_prompt_tokens 0).

    python benchmarks/bench_gpu.py [--shapes large-v3,large-v3-turbo]
        [--sections encoder,decode,engine,light] [--record]

Prints each section's table as it ends; --record appends them to the results log
(benchmarks/recording.py) and writes their figures to --json (benchmarks/results/gpu.json).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import typing
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.recording import markdown_table, record, titled_tables  # noqa: E402
from engine.config import EncoderAttention, EngineConfig, GPUSwitches  # noqa: E402
from engine.decode.engine import DecoderEngine  # noqa: E402
from engine.encode.overlap import OverlappedEncoder  # noqa: E402
from engine.encode.runner import EncoderRunner  # noqa: E402
from engine.kv.block_pool import blocks_needed  # noqa: E402
from engine.kv.sources import CrossKVTensor, EncoderStates  # noqa: E402
from engine.kv.storage import PagedKVStorage  # noqa: E402
from engine.model.audio import N_SAMPLES, log_mel_spectrogram  # noqa: E402
from engine.model.weights import resolve_model_folder  # noqa: E402
from engine.types import DecodeOptions  # noqa: E402
from tests.support.gpu_models import engine_model, random_hf_whisper  # noqa: E402

OUTPUT_TOKENS = 100
# The most windows an engine run's encoder forward takes, and the largest batch its CUDA graphs (where
# engine.gpu.encoder_cuda_graphs resolves on) are captured for.
ENGINE_ENCODER_BATCH = 64
HF_STATIC_LABEL = (
    "transformers (static batches of up to 64, 0.5 s batch wait)"  # its rows in the engine tables
)
# Peak HBM bandwidth by device name (vendor figures), for the decode bound.
PEAK_BANDWIDTH = {"H100 80GB HBM3": 3.35e12, "H100 PCIe": 2.0e12, "H100 NVL": 3.9e12, "H200": 4.8e12}


def add_dtype_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "float16", "bfloat16"],
        help="the engine's dtype ('auto': the engine's default on the device)",
    )


def resolved_dtype(device: str, dtype: str = "auto") -> torch.dtype:
    """The dtype the engine runs ``dtype`` in on ``device`` ("auto" resolved as EngineConfig does)."""
    return EngineConfig(device=device, dtype=dtype).torch_dtype


def release_memory(device: str) -> None:
    """Free what deleted engines held (their KV pools are tens of GB) before the next one is built
    (what a benchmark froze, as a replica freezes its start-up objects, goes back to the collector)."""
    gc.unfreeze()
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed_per_call(fn, device: str, min_seconds: float, warmup: int = 2) -> float:
    """Seconds per call of fn, after warm-up, repeating until min_seconds have passed."""
    for _ in range(warmup):
        fn()
    sync(device)
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        sync(device)
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds:
            return elapsed / calls


def peak_bandwidth(device: str) -> tuple[float, str]:
    if not device.startswith("cuda"):
        return 50e9, "nominal CPU"
    name = torch.cuda.get_device_name(0)
    for key, value in PEAK_BANDWIDTH.items():
        if key in name:
            return value, f"{name} spec"
    return measured_read_bandwidth(device), f"{name} measured"


def measured_read_bandwidth(device: str) -> float:
    x = torch.empty(2**30, dtype=torch.float32, device=device).fill_(1.0)  # 4 GiB
    seconds = timed_per_call(lambda: x.sum(), device, 0.5)
    return x.numel() * 4 / seconds


def fixed_options(timestamps: bool = False) -> DecodeOptions:
    return DecodeOptions(language="en", max_tokens=OUTPUT_TOKENS, ignore_eot=True, timestamps=timestamps)


# ----------------------------------------------------------------------------------- (a)
def bench_encoder(hf, loaded, device: str, batch_sizes: list[int], seconds: float) -> list[dict]:
    runner = EncoderRunner(loaded, graph_batch_size=max(batch_sizes))  # graphs where the app has them
    n_mels = loaded.weights.dims.n_mels
    windows = (torch.randn(max(batch_sizes), N_SAMPLES, device=device) * 0.1).float()
    rows = []
    for batch in batch_sizes:
        audio = windows[:batch]
        mels = log_mel_spectrogram(audio, n_mels).to(hf.dtype)
        with torch.inference_mode():
            ours = timed_per_call(lambda: runner.encode(audio), device, seconds)
            theirs = timed_per_call(lambda: hf.model.encoder(mels), device, seconds)
            cross_kv = timed_per_call(lambda: runner.cross_kv(runner.encode(audio)), device, seconds) - ours
        rows.append(dict(batch=batch, ours=batch / ours, hf=batch / theirs, cross_kv_ms=cross_kv * 1000))
        print(
            f"encoder bs{batch}: ours {batch / ours:.1f} windows/s, transformers {batch / theirs:.1f}, "
            f"cross-K/V projection +{cross_kv * 1000:.1f} ms",
            flush=True,
        )
    return rows


# ----------------------------------------------------------------------------------- (b)
def step_bytes(loaded, batch: int, mean_position: int) -> int:
    """Bytes one decode step must read: the decoder weights it uses (not the cross-K/V projections,
    applied once per request) and every request's cross- and self-attention K/V (in the cache's dtype)."""
    model, dims = loaded.model, loaded.weights.dims
    element = next(model.parameters()).element_size()
    kv_element = loaded.config.kv_cache_torch_dtype.itemsize
    weights = sum(p.numel() for name, p in model.decoder.named_parameters() if "cross_kv" not in name)
    kv_per_token = dims.decoder_layers * 2 * dims.d_model
    return weights * element + batch * kv_per_token * (dims.n_audio_ctx + mean_position) * kv_element


def config_for(
    loaded, max_num_seqs: int, kv_cache_dtype: str | None = None, beam_size: int = 1, **overrides
) -> EngineConfig:
    """The loaded engine config with a KV pool that holds ``max_num_seqs`` worst-case sequences
    (and, if given, another cache dtype and other settings). With ``beam_size`` > 1 they are
    windows of that many hypotheses, which share one copy of cross-attention K/V and their
    prompt's block."""
    gpu = {key: overrides.pop(key) for key in list(overrides) if key in GPUSwitches.model_fields}
    update = (
        dict(max_num_seqs=max_num_seqs)
        | (dict(kv_cache_dtype=kv_cache_dtype) if kv_cache_dtype else {})
        | overrides
    )
    config = EngineConfig.model_validate(loaded.config.model_dump() | update)
    config.gpu = config.gpu.model_copy(update=gpu)
    dims = loaded.weights.dims
    windows = max_num_seqs // beam_size
    blocks = windows * (
        blocks_needed(dims.n_audio_ctx, config.block_size)
        + beam_size * blocks_needed(dims.n_text_ctx, config.block_size)
        + (1 if beam_size > 1 else 0)
    )
    block_bytes = PagedKVStorage.bytes_per_block(
        dims.decoder_layers, config.block_size, dims.decoder_heads, dims.head_dim, config.kv_cache_torch_dtype
    )
    config.kv_cache_memory_mb = blocks * block_bytes / 2**20 + 64
    return config


def engine_at_batch(
    loaded, batch: int, device: str, timestamps: bool = False, **overrides
) -> tuple[DecoderEngine, list]:
    """An engine with ``batch`` requests admitted and past their prompts, ready to time decode steps."""
    config = config_for(loaded, batch, **overrides)
    dims = loaded.weights.dims
    engine = DecoderEngine(loaded, config)
    cross_kv = torch.randn(
        dims.decoder_layers,
        2,
        dims.n_audio_ctx,
        dims.decoder_heads,
        dims.head_dim,
        device=device,
        dtype=config.torch_dtype,
    )
    requests = [engine.make_request(fixed_options(timestamps), CrossKVTensor(cross_kv)) for _ in range(batch)]
    for request in requests:
        engine.submit(request)
    # Admission and the prompt (a token a step where decode steps replay CUDA graphs), then the first
    # sampled token fed back.
    while any(len(request.output_tokens) < 2 for request in requests):
        engine.step()
    return engine, requests


def engine_step_seconds(engine: DecoderEngine, device: str) -> float:
    """Mean wall time of the engine's next steps (forward, rules, sampling, bookkeeping)."""
    steps, start = 0, time.perf_counter()
    while engine.has_work and steps < OUTPUT_TOKENS - 5:
        engine.step()
        steps += 1
    sync(device)
    return (time.perf_counter() - start) / max(steps, 1)


def bench_decode(hf, loaded, device: str, batch_sizes: list[int], seconds: float) -> list[dict]:
    peak, peak_source = peak_bandwidth(device)
    rows = []
    dims = loaded.weights.dims
    for batch in batch_sizes:
        engine, requests = engine_at_batch(loaded, batch, device)
        runner = engine.runner
        # Forward only: replay the step at fixed positions (it rewrites the same K/V slots).
        step = engine.pipeline.step_input(requests)
        forward = timed_per_call(lambda: runner.execute(step), device, seconds)  # noqa: F821 (deleted after use)
        graphs = runner.graphs is not None and runner.graphs.fits(step)
        engine_step = engine_step_seconds(engine, device)
        del engine, requests, runner, step
        release_memory(device)  # two engines' KV pools at batch 128 do not fit beside each other
        # The same with timestamps on (srt, vtt, verbose_json): Whisper's timestamp rules each step.
        engine, _ = engine_at_batch(loaded, batch, device, timestamps=True)
        timestamps_step = engine_step_seconds(engine, device)
        del engine, _
        release_memory(device)
        # Each step's tokens read before the next step is launched: the host's work in series with the GPU's.
        engine, _ = engine_at_batch(loaded, batch, device, async_steps=False)
        in_turn_step = engine_step_seconds(engine, device)
        del engine, _
        release_memory(device)

        theirs = hf_decode_step_seconds(hf, batch, dims, device)
        bound = step_bytes(loaded, batch, OUTPUT_TOKENS // 2) / peak
        rows.append(
            dict(
                batch=batch,
                ours_forward_ms=forward * 1000,
                ours_engine_step_ms=engine_step * 1000,
                ours_timestamps_step_ms=timestamps_step * 1000,
                ours_in_turn_step_ms=in_turn_step * 1000,
                hf_ms=theirs * 1000,
                bound_ms=bound * 1000,
                cuda_graph=graphs,
            )
        )
        print(
            f"decode bs{batch}: ours forward {forward * 1000:.2f} ms (graph {graphs}), engine step "
            f"{engine_step * 1000:.2f} ms ({timestamps_step * 1000:.2f} with timestamps, "
            f"{in_turn_step * 1000:.2f} async steps off), transformers {theirs * 1000:.2f} ms, "
            f"bound {bound * 1000:.2f} ms "
            f"({peak_source} {peak / 1e12:.2f} TB/s)",
            flush=True,
        )
    return rows


def hf_prompt_ids(batch: int, device: str, tokenizer) -> torch.Tensor:
    special = tokenizer.special
    ids = [special.sot, tokenizer.language_tokens["en"], special.transcribe, special.no_timestamps]
    return torch.tensor([ids] * batch, device=device)


@torch.inference_mode()
def hf_generate(hf, mels_or_states, batch: int, device: str, tokenizer, new_tokens: int, from_states: bool):
    from transformers.generation import GenerationMixin
    from transformers.modeling_outputs import BaseModelOutput

    kwargs = (
        dict(encoder_outputs=BaseModelOutput(last_hidden_state=mels_or_states))
        if from_states
        else dict(input_features=mels_or_states)
    )
    return GenerationMixin.generate(
        hf,
        decoder_input_ids=hf_prompt_ids(batch, device, tokenizer),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        num_beams=1,
        eos_token_id=tokenizer.special.eot,
        pad_token_id=tokenizer.special.eot,
        **kwargs,
    )


_TOKENIZER = None


def hf_decode_step_seconds(hf, batch: int, dims, device: str) -> float:
    """transformers' static batch: (time for 1 + N tokens - time for 1 token) / N, from encoder states."""
    states = torch.randn(batch, dims.n_audio_ctx, dims.d_model, device=device, dtype=hf.dtype)
    short = timed_per_call(
        lambda: hf_generate(hf, states, batch, device, _TOKENIZER, 1, True), device, 0.5, warmup=1
    )
    long = timed_per_call(
        lambda: hf_generate(hf, states, batch, device, _TOKENIZER, 1 + OUTPUT_TOKENS // 2, True),
        device,
        0.5,
        warmup=1,
    )
    return (long - short) / (OUTPUT_TOKENS // 2)


# ----------------------------------------------------------------------------------- (c)
def poisson_arrivals(count: int, rate_per_s: float, seed: int = 0) -> np.ndarray:
    return np.cumsum(np.random.default_rng(seed).exponential(1.0 / rate_per_s, count))


def bench_engine_ours(
    loaded,
    encoder_runner: EncoderRunner,
    device: str,
    count: int,
    rate: float,
    encoder_batch: int,
    max_num_seqs: int,
    overlap: bool | None = None,
    kv_cache_dtype: str | None = None,
    **config_overrides,
) -> dict:
    """``encoder_runner``: built once by the caller for every row (building one compiles the encoder);
    ``config_overrides``: engine settings for this run."""
    # The decoder projects each request's cross-K/V at admission (transfer mode encoder_states):
    # 64 staged cross-K/V of large-v3 would hold 15.7 GB, their encoder states 0.25 GB.
    encoder = OverlappedEncoder(encoder_runner, project_cross_kv=False, overlap=overlap)
    engine = DecoderEngine(loaded, config_for(loaded, max_num_seqs, kv_cache_dtype, **config_overrides))
    window = (torch.randn(encoder_batch, N_SAMPLES, device=device) * 0.1).float()
    encoder.runner.encode(window)  # warm-up at the batch size used most
    # Warm-up of the engine: one request end to end compiles the prompt step's kernels.
    engine.submit(engine.make_request(fixed_options(), EncoderStates(encoder.runner.encode(window[:1])[0])))
    while engine.has_work:
        engine.step()
    arrivals = poisson_arrivals(count, rate)
    arrived_at: dict[str, float] = {}
    latencies: list[float] = []
    next_arrival = encoded = in_flight = 0
    # Where the wall time goes: engine steps (the encoder runs beside them when overlapped), and the
    # batch each step ran.
    step_s = 0.0
    steps = batched = 0
    start = time.perf_counter()
    while len(latencies) < count:
        now = time.perf_counter() - start
        while next_arrival < count and arrivals[next_arrival] <= now:
            next_arrival += 1
        pending = next_arrival - encoded - in_flight
        # Encode when the decoder could admit the batch soon: keeps staged K/V bounded.
        if not encoder.busy and pending and engine.stats().num_waiting < encoder_batch:
            in_flight = min(pending, encoder_batch)
            encoder.submit(window[:in_flight])
        states = encoder.take(wait=not engine.has_work) if encoder.busy else None
        if states is not None:
            for index in range(in_flight):
                request = engine.make_request(fixed_options(), EncoderStates(states[index]))
                arrived_at[request.request_id] = start + arrivals[encoded + index]
                engine.submit(request)
            encoded += in_flight
            in_flight = 0
        if engine.has_work:
            began = time.perf_counter()
            results = engine.step()
            step_s += time.perf_counter() - began
            steps += 1
            batched += len(engine.scheduler.running) + len(results)
            for result in results:
                latencies.append(time.perf_counter() - arrived_at[result.request_id])
        elif not encoder.busy and next_arrival < count:
            time.sleep(max(0.0, arrivals[next_arrival] - (time.perf_counter() - start)))
    seconds = time.perf_counter() - start - arrivals[0]
    encoder.close()
    del engine, encoder
    release_memory(device)
    return dict(
        req_per_s=count / seconds,
        p50_latency_s=float(np.median(latencies)),
        p90_latency_s=float(np.percentile(latencies, 90)),
        seconds=seconds,
        step_s=step_s,
        steps=steps,
        mean_batch=batched / max(steps, 1),
    )


def bench_engine_hf(
    hf, device: str, count: int, rate: float, batch_size: int, n_mels: int, batch_wait_s: float = 0.5
) -> dict:
    """Static batching: a batch starts when ``batch_size`` requests wait, or the oldest has waited
    ``batch_wait_s``, or no more will come; it runs to its end before the next one starts."""
    window = (torch.randn(batch_size, N_SAMPLES, device=device) * 0.1).float()
    mels = log_mel_spectrogram(window, n_mels).to(hf.dtype)
    hf_generate(hf, mels, batch_size, device, _TOKENIZER, 2, False)  # warm-up at the full batch
    arrivals = poisson_arrivals(count, rate)
    latencies: list[float] = []
    done = 0
    start = time.perf_counter()
    while done < count:
        now = time.perf_counter() - start
        arrived = int(np.searchsorted(arrivals, now, side="right"))
        full = arrived - done >= batch_size or arrived == count
        if arrived == done or not (full or now - arrivals[done] >= batch_wait_s):
            time.sleep(0.001)
            continue
        batch = min(arrived - done, batch_size)
        mels = log_mel_spectrogram(window[:batch], n_mels).to(hf.dtype)
        hf_generate(hf, mels, batch, device, _TOKENIZER, OUTPUT_TOKENS, False)
        sync(device)
        finished = time.perf_counter()
        latencies += [finished - (start + arrivals[done + i]) for i in range(batch)]
        done += batch
    seconds = time.perf_counter() - start - arrivals[0]
    return dict(
        req_per_s=count / seconds,
        p50_latency_s=float(np.median(latencies)),
        p90_latency_s=float(np.percentile(latencies, 90)),
    )


def bench_light_load(hf, loaded, device: str, args, prefix: str, metrics: dict) -> tuple[str, str]:
    """(c, light) Latency under a light load, well under our engine's capacity, where a step rarely
    admits more than a few requests: ours as configured, ours feeding each prompt in one (eager)
    step, and transformers' static batching (which at this rate runs small batches)."""
    encoder_runner = EncoderRunner(loaded, graph_batch_size=ENGINE_ENCODER_BATCH)
    runs = {
        "ours": {},
        "ours, prompts in one eager step (stepped_prompt_tokens 0)": dict(stepped_prompt_tokens=0),
    }
    results = {}
    for label, overrides in runs.items():
        results[label] = bench_engine_ours(
            loaded,
            encoder_runner,
            device,
            args.light_requests,
            args.light_rate,
            ENGINE_ENCODER_BATCH,
            args.max_num_seqs,
            **overrides,
        )
        print(f"light load {label}: {results[label]}", flush=True)
    del encoder_runner
    results[HF_STATIC_LABEL] = bench_engine_hf(
        hf, device, args.light_requests, args.light_rate, 64, loaded.weights.dims.n_mels
    )
    ours, theirs = results["ours"], results[HF_STATIC_LABEL]
    metrics[f"{prefix}light_load_p50_latency_s"] = round(ours["p50_latency_s"], 3)
    metrics[f"{prefix}hf_light_load_p50_latency_s"] = round(theirs["p50_latency_s"], 3)
    rows = [
        [
            label,
            round(r["req_per_s"], 1),
            round(r["p50_latency_s"], 2),
            round(r["p90_latency_s"], 2),
            round(theirs["p50_latency_s"] / r["p50_latency_s"], 2),
            round(r["mean_batch"], 1) if "mean_batch" in r else "",
        ]
        for label, r in results.items()
    ]
    title = (
        f"{loaded.config.model}: latency under light load, Poisson stream at {args.light_rate:g}/s, "
        f"{args.light_requests} requests"
    )
    return title, markdown_table(
        [
            "",
            "requests/s",
            "p50 latency s",
            "p90 latency s",
            "transformers p50 / this p50",
            "mean decode batch",
        ],
        rows,
    )


def roofline_req_per_s(
    loaded, device: str, encoder_windows_per_s: float | None, kv_element_bytes: int = 2
) -> tuple[float, float]:
    """Upper bounds from cross-attention K/V reads alone: decode only, and with the encoder sharing
    the GPU."""
    dims = loaded.weights.dims
    peak, _ = peak_bandwidth(device)
    per_request = OUTPUT_TOKENS * dims.decoder_layers * 2 * dims.n_audio_ctx * dims.d_model * kv_element_bytes
    decode_only = peak / per_request
    if not encoder_windows_per_s:
        return decode_only, float("nan")
    return decode_only, 1.0 / (1.0 / decode_only + 1.0 / encoder_windows_per_s)


# ----------------------------------------------------------------------------------- main
def main() -> None:
    global _TOKENIZER
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", default="large-v3,large-v3-turbo")
    parser.add_argument("--sections", default="encoder,decode,engine,light")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokenizer", type=Path, default=None, help="a multilingual Whisper tokenizer.json")
    parser.add_argument("--encoder-batches", default="1,8,32,64")
    parser.add_argument("--decode-batches", default="1,16,64,128")
    parser.add_argument(
        "--requests",
        type=int,
        default=1024,
        help="requests in the engine stream (a few decode batches' worth, so that the start and "
        "the drain at the end weigh little: 256 is one fp8 batch)",
    )
    parser.add_argument("--rate", type=float, default=400.0, help="Poisson arrival rate, requests/s")
    parser.add_argument(
        "--light-rate",
        type=float,
        default=15.0,
        help="Poisson arrival rate of section light (latency under a light load)",
    )
    parser.add_argument("--light-requests", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument(
        "--json",
        type=Path,
        default=Path(__file__).parent / "results" / "gpu.json",
        help="where --record writes the metrics (a partial run belongs in a file of its own)",
    )
    parser.add_argument("--seconds", type=float, default=1.0, help="least time per timed measurement")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e4m3"])
    parser.add_argument("--no-cuda-graphs", action="store_true")
    parser.add_argument("--fp8-encoder", action="store_true", help="engine.gpu.fp8_encoder (ours only)")
    parser.add_argument(
        "--encoder-attention",
        default="auto",
        choices=typing.get_args(EncoderAttention),
        help="engine.gpu.encoder_attention (ours only)",
    )
    add_dtype_argument(parser)
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()
    device = args.device
    tokenizer_file = args.tokenizer or resolve_model_folder("base") / "tokenizer.json"
    sections = set(args.sections.split(","))
    metrics: dict[str, float] = {}
    tables: list[tuple[str, str]] = []

    for shape in args.shapes.split(","):
        prefix = "" if shape == "large-v3" else shape.replace("large-v3-", "") + "_"
        prefix += "fp8kv_" if args.kv_cache_dtype == "fp8_e4m3" else ""
        prefix += "fp8enc_" if args.fp8_encoder else ""
        prefix += "fa3_" if args.encoder_attention == "flash_attn_3" else ""
        dtype = resolved_dtype(device, args.dtype)
        hf = random_hf_whisper(shape, device, dtype)
        config = EngineConfig(
            model=shape,
            device=device,
            dtype=str(dtype).removeprefix("torch."),
            attention_backend=args.attention_backend,
            kv_cache_dtype=args.kv_cache_dtype,
            gpu={
                "cuda_graphs": not args.no_cuda_graphs,
                "fp8_encoder": args.fp8_encoder,
                "encoder_attention": args.encoder_attention,
            },
        )
        loaded = engine_model(hf, tokenizer_file, config)
        _TOKENIZER = loaded.tokenizer
        encoder_rate = None
        if "encoder" in sections:
            rows = bench_encoder(
                hf, loaded, device, [int(b) for b in args.encoder_batches.split(",")], args.seconds
            )
            tables.append(
                (
                    f"{shape}: encoder windows/s (a)",
                    markdown_table(
                        [
                            "batch",
                            "ours (log-mel + encoder)",
                            "transformers (encoder)",
                            "ours / transformers",
                            "+ cross-K/V projection, ms",
                        ],
                        [
                            [
                                r["batch"],
                                round(r["ours"], 1),
                                round(r["hf"], 1),
                                round(r["ours"] / r["hf"], 2),
                                round(r["cross_kv_ms"], 1),
                            ]
                            for r in rows
                        ],
                    ),
                )
            )
            last = rows[-1]
            encoder_rate = last["ours"]
            metrics[f"{prefix}encoder_windows_per_s_bs{last['batch']}"] = round(last["ours"], 1)
            metrics[f"{prefix}hf_encoder_windows_per_s_bs{last['batch']}"] = round(last["hf"], 1)
            metrics[f"{prefix}encoder_speedup_vs_hf_bs{last['batch']}"] = round(last["ours"] / last["hf"], 2)
        if "decode" in sections:
            rows = bench_decode(
                hf, loaded, device, [int(b) for b in args.decode_batches.split(",")], args.seconds
            )
            tables.append(
                (
                    f"{shape}: decode ms per step (b)",
                    markdown_table(
                        [
                            "batch",
                            "ours: forward (CUDA graph)",
                            "ours: engine step",
                            "ours: engine step, timestamps on",
                            "ours: engine step, async steps off",
                            "transformers",
                            "bandwidth bound",
                            "ours forward / bound",
                            "transformers / ours step",
                        ],
                        [
                            [
                                r["batch"],
                                round(r["ours_forward_ms"], 2),
                                round(r["ours_engine_step_ms"], 2),
                                round(r["ours_timestamps_step_ms"], 2),
                                round(r["ours_in_turn_step_ms"], 2),
                                round(r["hf_ms"], 2),
                                round(r["bound_ms"], 2),
                                round(r["ours_forward_ms"] / r["bound_ms"], 2),
                                round(r["hf_ms"] / r["ours_engine_step_ms"], 2),
                            ]
                            for r in rows
                        ],
                    ),
                )
            )
            for r in rows:
                metrics[f"{prefix}decode_ms_per_step_bs{r['batch']}"] = round(r["ours_forward_ms"], 3)
                metrics[f"{prefix}decode_engine_step_ms_bs{r['batch']}"] = round(r["ours_engine_step_ms"], 3)
                metrics[f"{prefix}decode_engine_step_timestamps_ms_bs{r['batch']}"] = round(
                    r["ours_timestamps_step_ms"], 3
                )
                metrics[f"{prefix}decode_engine_step_async_off_ms_bs{r['batch']}"] = round(
                    r["ours_in_turn_step_ms"], 3
                )
                metrics[f"{prefix}decode_ms_per_step_bs{r['batch']}_bound"] = round(r["bound_ms"], 3)
                metrics[f"{prefix}hf_decode_ms_per_step_bs{r['batch']}"] = round(r["hf_ms"], 3)
        if "engine" in sections:
            headline_label = "ours (continuous batching, encoder on its own stream)"
            inline_label = "ours, encoder inline (same stream, between steps)"
            in_turn_label = "ours, async steps off (each step read before the next is launched)"
            fp8_labels = (
                f"ours, fp8 K/V cache, {2 * args.max_num_seqs} requests at once, encoder on its own stream",
                f"ours, fp8 K/V cache, {2 * args.max_num_seqs} requests at once, encoder inline",
            )
            runs = {
                headline_label: dict(),
                inline_label: dict(overlap=False),
                in_turn_label: dict(async_steps=False),
            }
            if args.kv_cache_dtype == "auto":
                # The same KV memory holds twice the requests in fp8.
                fp8 = dict(kv_cache_dtype="fp8_e4m3", max_num_seqs=2 * args.max_num_seqs)
                runs[fp8_labels[0]] = fp8
                runs[fp8_labels[1]] = fp8 | dict(overlap=False)
            results = {}
            encoder_runner = EncoderRunner(loaded, graph_batch_size=ENGINE_ENCODER_BATCH)
            for label, options in runs.items():
                options = dict(max_num_seqs=args.max_num_seqs) | options
                results[label] = bench_engine_ours(
                    loaded, encoder_runner, device, args.requests, args.rate, ENGINE_ENCODER_BATCH, **options
                )
                print(f"engine {label}: {results[label]}", flush=True)
            theirs = bench_engine_hf(hf, device, args.requests, args.rate, 64, loaded.weights.dims.n_mels)
            print(f"engine transformers: {theirs}", flush=True)
            # (decode only, with the encoder) by bytes per cached K/V element: bf16 2, fp8 1
            rooflines = {size: roofline_req_per_s(loaded, device, encoder_rate, size) for size in (1, 2)}
            rows = []
            for (label, options), result in zip(runs.items(), results.values()):
                fp8 = options.get("kv_cache_dtype") == "fp8_e4m3" or args.kv_cache_dtype == "fp8_e4m3"
                decode_only, with_encoder = rooflines[1 if fp8 else 2]
                rows.append(
                    [
                        label,
                        round(result["req_per_s"], 1),
                        round(result["p50_latency_s"], 2),
                        round(result["req_per_s"] / theirs["req_per_s"], 2),
                        round(result["mean_batch"], 1),
                        round(decode_only, 1),
                        round(with_encoder, 1),
                    ]
                )
            rows.append(
                [
                    HF_STATIC_LABEL,
                    round(theirs["req_per_s"], 1),
                    round(theirs["p50_latency_s"], 2),
                    1.0,
                    "",
                    "",
                    "",
                ]
            )
            tables.append(
                (
                    f"{shape}: engine requests/s, Poisson stream at {args.rate:g}/s, "
                    f"{OUTPUT_TOKENS} tokens each (c)",
                    markdown_table(
                        [
                            "",
                            "requests/s",
                            "p50 latency s",
                            "/ transformers",
                            "mean decode batch",
                            "cross-K/V roofline, decode only",
                            "roofline with the encoder",
                        ],
                        rows,
                    ),
                )
            )
            headline, inline = results[headline_label], results[inline_label]
            metrics[f"{prefix}engine_req_per_s"] = round(headline["req_per_s"], 1)
            metrics[f"{prefix}hf_engine_req_per_s"] = round(theirs["req_per_s"], 1)
            metrics[f"{prefix}engine_speedup_vs_hf"] = round(headline["req_per_s"] / theirs["req_per_s"], 2)
            metrics[f"{prefix}engine_roofline_req_per_s"] = round(
                rooflines[1 if args.kv_cache_dtype == "fp8_e4m3" else 2][1], 1
            )
            metrics[f"{prefix}engine_req_per_s_encoder_inline"] = round(inline["req_per_s"], 1)
            metrics[f"{prefix}engine_req_per_s_async_off"] = round(results[in_turn_label]["req_per_s"], 1)
            if fp8_labels[0] in results:
                overlapped, fp8_inline = results[fp8_labels[0]], results[fp8_labels[1]]
                metrics[f"{prefix}fp8kv_engine_req_per_s"] = round(overlapped["req_per_s"], 1)
                metrics[f"{prefix}fp8kv_engine_speedup_vs_hf"] = round(
                    overlapped["req_per_s"] / theirs["req_per_s"], 2
                )
                metrics[f"{prefix}fp8kv_engine_req_per_s_encoder_inline"] = round(fp8_inline["req_per_s"], 1)
                metrics[f"{prefix}fp8kv_engine_speedup_vs_hf_encoder_inline"] = round(
                    fp8_inline["req_per_s"] / theirs["req_per_s"], 2
                )
                metrics[f"{prefix}fp8kv_engine_roofline_req_per_s"] = round(rooflines[1][1], 1)
        if "light" in sections:
            tables.append(bench_light_load(hf, loaded, device, args, prefix, metrics))
        del hf, loaded
        release_memory(device)

    for title, table in tables:
        print(f"\n### {title}\n\n{table}")
    print(metrics)
    if args.record:
        body = titled_tables(tables)
        record(
            "GPU: ours vs transformers on random weights of the large shapes (bench_gpu.py)",
            body,
            f"dtype {args.dtype} for both, SDPA in transformers; ours: Triton paged attention, decode "
            "steps from CUDA graphs. "
            "Bandwidth bound: decoder weights + every request's cross- and self-attention K/V, over the "
            "GPU's peak bandwidth.",
            json_path=args.json,
            metrics=metrics,
        )


if __name__ == "__main__":
    main()
