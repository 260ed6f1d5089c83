"""Every shipped config validates, and a wrong one fails at start-up naming the field and why."""

from __future__ import annotations

import re

import pytest
import torch
import yaml

from deployments.config import ConfigError, RealtimeOptions, parse_app_config
from tests.support.paths import CONFIGS_DIR
from tests.support.serving import default_app_args, shipped_default_args

CONFIGS = sorted(CONFIGS_DIR.glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_shipped_config_is_a_valid_serve_config_with_valid_app_args(path):
    spec = yaml.safe_load(path.read_text())
    application = spec["applications"][0]
    assert application["import_path"] == "deployments.app:build_app"
    config = parse_app_config(application["args"])
    assert config.engine.model and config.encoder.max_batch_size >= 1


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_shipped_config_decodes_only_speech_for_requests_without_a_chunking_strategy(path):
    """Silence gives an empty transcript, as OpenAI's API answers it (docs/api.md)."""
    config = parse_app_config(yaml.safe_load(path.read_text())["applications"][0]["args"])
    assert config.http.vad_by_default


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_no_shipped_config_accepts_the_benchmark_only_fields_or_live_benchmark_decoding(path):
    """`fixed_output_tokens` from any client would force full-length decoding of every window."""
    config = parse_app_config(yaml.safe_load(path.read_text())["applications"][0]["args"])
    assert not config.http.benchmark_fields and config.realtime.fixed_output_tokens is None


def _disaggregated_models(path) -> list:
    """A shipped config's disaggregated models, each as its replicas see the config."""
    config = parse_app_config(yaml.safe_load(path.read_text())["applications"][0]["args"])
    return [config.serving(model) for model in config.models if model.placement == "disaggregated"]


@pytest.mark.parametrize(
    "path",
    [p for p in CONFIGS if _disaggregated_models(p)],
    ids=[p.stem for p in CONFIGS if _disaggregated_models(p)],
)
def test_every_shipped_disaggregated_config_stages_a_whole_encoder_batch(path):
    """A batch larger than its staging is handed on window by window, but its later windows wait for
    pulls: no shipped config makes its encoder wait so. The GPU configs name models this machine cannot
    load, so their dimensions come from the benchmarks' table of real shapes."""
    from deployments.encoder import window_layout
    from engine.model.weights import hugging_face_dims, load_weights
    from kv_transfer import sender_class
    from tests.support.gpu_models import SHAPES

    for config in _disaggregated_models(path):
        model = config.engine.model
        if model.startswith("openai/whisper-"):
            shape = {**SHAPES[model.removeprefix("openai/whisper-")], "max_source_positions": 1500}
            dims = hugging_face_dims({**shape, "max_target_positions": 448})
        else:
            dims = load_weights(model).dims
        window = window_layout(dims, config.engine, config.transfer.resolved_mode())
        batch_bytes = config.encoder.max_batch_size * sender_class(config.transfer).staged_bytes(window)
        assert batch_bytes <= config.transfer.staging_memory_mb * 2**20, (
            f"{path.name}, {model}: {config.encoder.max_batch_size} windows of "
            f"{window.nbytes / 2**20:.1f} MB exceed {config.transfer.staging_memory_mb} MB of staging"
        )


def test_the_default_config_serves_tiny_en_by_default_and_base_each_on_its_own_cpu_replicas_on_port_8000():
    spec = yaml.safe_load((CONFIGS[0].parent / "default.yaml").read_text())
    config = parse_app_config(spec["applications"][0]["args"])
    assert spec["http_options"]["port"] == 8000
    assert [model.ids for model in config.models] == [["tiny.en", "whisper-1"], ["base"]]
    assert config.default_model.name == "tiny.en" and config.model_named("whisper-1").name == "tiny.en"
    for model in config.models:
        assert model.engine.device == "cpu" and model.placement == "disaggregated"
        assert (model.encoder.num_replicas, model.decoder.num_replicas) == (1, 1)
        assert model.transfer.connector == "nixl"
    # Ray's logical CPUs: every replica of the app fits a 2-core machine.
    replicas = [config.ingress] + [side for model in config.models for side in (model.encoder, model.decoder)]
    assert sum(options.num_cpus * options.num_replicas for options in replicas) <= 2


def test_the_one_model_app_tests_start_is_the_default_configs_default_model():
    one_model = parse_app_config(default_app_args())
    shipped = parse_app_config(shipped_default_args())
    assert len(one_model.models) == 1
    assert one_model.models[0].model_dump() == shipped.default_model.model_dump()
    assert (one_model.http, one_model.ingress) == (shipped.http, shipped.ingress)


@pytest.mark.parametrize(
    "args, field, reason",
    [
        ({"engine": {"block_size": 12}}, "engine.block_size", "power of two"),
        ({"engine": {"modle": "tiny.en"}}, "engine.modle", "Extra inputs"),
        ({"encoder": {"max_batch_size": 0}}, "encoder.max_batch_size", "greater than or equal to 1"),
        ({"transfer": {"connector": "carrier-pigeon"}}, "transfer.connector", "nixl"),
        ({"served_model_names": []}, "served_model_names", "at least one"),
        ({"decoder": {"autoscaling": {"min_replicas": 0}}}, "decoder.autoscaling", "scale_to_zero"),
        (
            {"encoder": {"autoscaling": {"min_replicas": 3, "max_replicas": 2}}},
            "encoder.autoscaling",
            "below min_replicas",
        ),
        ({"engine": {"max_num_seqs": 4, "interactive_reserved_seqs": 4}}, "engine", "batch-priority work"),
        ({"engine": {"kv_cache_dtype": "int8"}}, "engine.kv_cache_dtype", "fp8_e4m3"),
        (
            {"engine": {"max_num_seqs": 4}, "http": {"default_beam_size": 5}},
            "http.default_beam_size",
            "each beam runs as a sequence",
        ),
        (
            {"engine": {"max_num_seqs": 4}, "realtime": {"final_beam_size": 5}},
            "realtime.final_beam_size",
            "4",
        ),
        (
            {"engine": {"kv_cache_dtype": "fp8_e4m3", "attention_backend": "flash_attn"}},
            "engine",
            "cannot read an fp8 KV cache",
        ),
        ({"engine": {"gpu": {"encoder_sm_share": 0}}}, "engine.gpu.encoder_sm_share", "greater than 0"),
        ({"engine": {"gpu": {"encoder_sm_share": 1.5}}}, "engine.gpu.encoder_sm_share", "less than or equal"),
        ({"diarizer": {"max_batch_size": 0}}, "diarizer.max_batch_size", "greater than or equal to 1"),
        ({"diarizer": {"min_speakers": 2}}, "diarizer.min_speakers", "Extra inputs"),
    ],
)
def test_a_bad_config_fails_naming_the_field_and_the_reason(args, field, reason):
    with pytest.raises(ConfigError) as failure:
        parse_app_config(args)
    assert field in str(failure.value) and reason in str(failure.value)


def test_an_fp8_kv_cache_is_set_in_the_engine_section_that_encoders_and_decoders_share():
    args = default_app_args()
    assert parse_app_config(args).engine.kv_cache_torch_dtype == torch.float32  # auto: the model's dtype
    args["engine"]["kv_cache_dtype"] = "fp8_e4m3"
    config = parse_app_config(args)  # deployments/app.py binds this one config to both deployments
    assert (
        config.engine.kv_cache_dtype == "fp8_e4m3"
        and config.engine.kv_cache_torch_dtype == torch.float8_e4m3fn
    )


def test_the_largest_beam_a_request_may_ask_for_fits_the_decoders_sequences():
    assert parse_app_config({}).largest_beam_size == 8
    assert parse_app_config({"engine": {"max_num_seqs": 2}}).largest_beam_size == 2


def test_api_keys_come_from_the_environment_when_the_config_gives_none(monkeypatch):
    monkeypatch.setenv("WHISPER_DISAGG_API_KEYS", "key-one, key-two")
    assert parse_app_config({}).http.api_keys == ["key-one", "key-two"]
    assert parse_app_config({"http": {"api_keys": ["from-yaml"]}}).http.api_keys == ["from-yaml"]


def test_scale_to_zero_is_off_by_default_and_allowed_when_asked():
    assert parse_app_config({"decoder": {"autoscaling": {}}}).decoder.autoscaling.scale_to_zero is False
    allowed = parse_app_config({"decoder": {"autoscaling": {"min_replicas": 0, "scale_to_zero": True}}})
    assert allowed.decoder.autoscaling.min_replicas == 0


def test_the_kuberay_example_serves_valid_args_and_its_worker_groups_offer_the_resources_asked_for():
    manifest = yaml.safe_load((CONFIGS[0].parents[1] / "docs" / "kuberay-rayservice.yaml").read_text())
    serve_config = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    config = parse_app_config(serve_config["applications"][0]["args"])
    offered = {
        key
        for group in manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]
        for key in yaml.safe_load(group["rayStartParams"]["resources"].strip('"').replace('\\"', '"'))
    }
    assert set(config.encoder.resources) | set(config.decoder.resources) <= offered


def test_every_gpu_speed_switch_asked_for_is_on_for_cuda_and_off_on_a_cpu():
    from engine.config import EngineConfig, GPUSwitches

    # Every on/off switch; async_steps is left out: asked for, a CPU runs it too (tests do).
    asked = {
        name: True
        for name, field in GPUSwitches.model_fields.items()
        if field.annotation in (bool, bool | None) and name != "async_steps"
    }
    on_cuda = EngineConfig(device="cuda", dtype="float16", gpu=asked).gpu_switches()
    on_cpu = EngineConfig(device="cpu", gpu=asked).gpu_switches()
    assert {"encoder_cuda_graphs", "fp8_encoder", "encoder_stream_first"} <= set(asked)
    for name in asked:
        assert getattr(on_cuda, name), f"{name} is off for CUDA in float16 when asked for"
        assert not getattr(on_cpu, name), f"{name} is on for a CPU"


@pytest.mark.parametrize(
    ("device", "fp8_encoder", "asked", "resolved"),
    [
        ("cuda", True, None, True),
        ("cuda", False, None, False),
        ("cuda", True, False, False),
        ("cuda", False, True, True),
        ("cpu", True, None, False),
    ],
)
def test_the_encoders_cuda_graphs_are_on_with_the_fp8_encoder_unless_turned_off(
    device, fp8_encoder, asked, resolved
):
    from engine.config import EngineConfig

    gpu = {"fp8_encoder": fp8_encoder} | ({} if asked is None else {"encoder_cuda_graphs": asked})
    assert EngineConfig(device=device, gpu=gpu).gpu_switches().encoder_cuda_graphs is resolved


@pytest.mark.parametrize(
    ("device", "share", "resolved"),
    [("cuda", 0.6, 0.6), ("cuda", 1, None), ("cuda", None, None), ("cpu", 0.6, None)],
)
def test_the_encoders_sm_share_partitions_a_gpu_only_and_never_a_whole_one(device, share, resolved):
    """A share below 1 on a GPU is kept for the encoder's stream; all of it is no partition, and a
    CPU has no SMs to share."""
    from engine.config import EngineConfig

    config = EngineConfig(device=device, gpu={"encoder_sm_share": share})
    assert config.gpu_switches().encoder_sm_share == resolved


def test_only_the_ingress_replicas_get_the_inline_window_limit_and_zero_keeps_rays():
    from deployments.app import build_whisper_app
    from deployments.config import AppConfig

    def actor_options(http: dict) -> dict[str, dict]:
        app = build_whisper_app(AppConfig(http=http))
        ingress = app._bound_deployment
        (encoder, decoder), *_ = ingress.init_args[1].values()  # one model's deployments
        bound = [ingress, encoder._bound_deployment, decoder._bound_deployment]
        return {deployment.name: deployment.ray_actor_options for deployment in bound}

    options = actor_options({"inline_window_kb": 256})
    assert set(options) == {"WhisperIngress", "WhisperEncoder", "WhisperDecoder"}
    assert options["WhisperIngress"]["runtime_env"] == {
        "env_vars": {"RAY_max_direct_call_object_size": str(256 * 1024)}
    }
    assert all("runtime_env" not in value for name, value in options.items() if name != "WhisperIngress")
    assert "runtime_env" not in actor_options({"inline_window_kb": 0})["WhisperIngress"]
    assert "runtime_env" not in actor_options({})["WhisperIngress"], "the default keeps Ray's limit"


@pytest.mark.parametrize(
    ("haproxy", "session_router"), [(None, True), ("0", True), ("true", True), ("1", False)]
)
def test_the_ingress_routes_live_sessions_by_room_unless_serve_runs_behind_haproxy(
    monkeypatch, haproxy, session_router
):
    """Serve's own rule for RAY_SERVE_ENABLE_HA_PROXY: off unless set, and only "1" turns it on.
    Behind HAProxy, HAProxy picks the replica and Serve refuses a router on the ingress."""
    from deployments.app import build_whisper_app
    from deployments.config import AppConfig

    if haproxy is None:
        monkeypatch.delenv("RAY_SERVE_ENABLE_HA_PROXY", raising=False)
    else:
        monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", haproxy)
    router = build_whisper_app(AppConfig())._bound_deployment._deployment_config.request_router_config
    assert (router.request_router_class == "deployments.routing.SessionRoomRouter") == session_router
    assert router.is_default_request_router() != session_router


def test_an_encoder_whose_staging_cannot_hold_one_window_refuses_to_start_and_says_what_would():
    from deployments.encoder import EncoderDeployment, window_layout
    from engine.model.weights import load_weights
    from kv_transfer.local import LocalSender

    args = {
        "engine": {"model": "tiny.en", "device": "cpu"},
        "transfer": {"connector": "local", "staging_memory_mb": 8},
        "encoder": {"max_batch_size": 4},
    }
    with pytest.raises(ConfigError, match=r"staging_memory_mb \(8\) cannot hold one") as refused:
        EncoderDeployment(parse_app_config(args))
    one_mb, batch_mb = (
        int(n)
        for n in re.search(r"at least (\d+), or to (\d+) to stage a whole", str(refused.value)).groups()
    )
    window = window_layout(load_weights("tiny.en").dims, parse_app_config(args).engine, "cross_kv")
    assert one_mb * 2**20 >= LocalSender.staged_bytes(window) > (one_mb - 1) * 2**20
    assert batch_mb * 2**20 >= 4 * LocalSender.staged_bytes(window) > (batch_mb - 1) * 2**20
    config = parse_app_config({**args, "transfer": {**args["transfer"], "staging_memory_mb": one_mb}})
    deployment = EncoderDeployment(config)  # the size it named starts, and holds one window
    try:
        assert deployment.sender.holds_at_once(window) == 1
    finally:
        deployment.sender.close()


TWO_MODELS = [
    {"engine": {"model": "tiny.en"}, "aliases": ["whisper-1"], "default": True},
    {"name": "base", "engine": {"model": "base", "max_num_seqs": 4}},
]


def test_a_config_without_models_is_one_model_named_by_its_engine_and_answering_to_its_served_names():
    config = parse_app_config(
        {"engine": {"model": "tiny.en"}, "served_model_names": ["whisper-1", "tiny.en"]}
    )
    (model,) = config.models
    assert (model.name, model.aliases, model.default) == ("tiny.en", ["whisper-1"], True)
    assert config.model_named("whisper-1") is model and config.model_named("base") is None


def test_each_model_is_served_with_its_own_engine_and_limits_and_the_top_level_reads_as_the_default():
    config = parse_app_config({"models": TWO_MODELS, "http": {"max_beam_size": 8}})
    assert config.accepted_model_names == ["tiny.en", "whisper-1", "base"]
    assert config.engine.model == "tiny.en" and config.largest_beam_size == 8
    base = config.serving(config.model_named("base"))
    assert (base.engine.model, base.largest_beam_size, base.accepted_model_names) == ("base", 4, ["base"])


def test_each_model_gets_an_encoder_and_a_decoder_deployment_of_its_own_with_its_own_replica_options():
    from deployments.app import build_whisper_app

    models = [
        {**TWO_MODELS[0], "decoder": {"num_replicas": 2, "num_cpus": 0.25}},
        {
            **TWO_MODELS[1],
            "encoder": {"resources": {"encoder_node": 1}},
            "decoder": {"autoscaling": {"max_replicas": 3}},
        },
    ]
    ingress = build_whisper_app(parse_app_config({"models": models}))._bound_deployment
    bound = {name: [side._bound_deployment for side in sides] for name, sides in ingress.init_args[1].items()}
    assert {name: [d.name for d in sides] for name, sides in bound.items()} == {
        "tiny.en": ["WhisperEncoder-tiny.en", "WhisperDecoder-tiny.en"],
        "base": ["WhisperEncoder-base", "WhisperDecoder-base"],
    }
    tiny_decoder, (base_encoder, base_decoder) = bound["tiny.en"][1], bound["base"]
    assert (tiny_decoder._deployment_config.num_replicas, tiny_decoder.ray_actor_options["num_cpus"]) == (
        2,
        0.25,
    )
    assert base_encoder.ray_actor_options["resources"] == {"encoder_node": 1}
    assert base_decoder._deployment_config.autoscaling_config.max_replicas == 3
    assert base_decoder.init_args[0].engine.model == "base", "the decoder loads its own model"


@pytest.mark.parametrize(
    "models, reason",
    [
        ([TWO_MODELS[0], {**TWO_MODELS[1], "name": "tiny.en"}], "the id 'tiny.en' is given twice"),
        ([TWO_MODELS[0], {**TWO_MODELS[1], "aliases": ["whisper-1"]}], "the id 'whisper-1' is given twice"),
        ([{**TWO_MODELS[0], "default": False}, TWO_MODELS[1]], "no model is the default"),
        ([TWO_MODELS[0], {**TWO_MODELS[1], "default": True}], "tiny.en, base are each marked"),
        ([{**TWO_MODELS[0], "name": "org/x"}, {**TWO_MODELS[1], "name": "org-x"}], "same deployment name"),
        ([TWO_MODELS[0], {**TWO_MODELS[1], "name": ""}], "at least 1 character"),
    ],
)
def test_models_must_answer_to_distinct_ids_and_exactly_one_is_the_default(models, reason):
    with pytest.raises(ConfigError) as failure:
        parse_app_config({"models": models})
    assert "models" in str(failure.value) and reason in str(failure.value)


@pytest.mark.parametrize(
    "args, field, reason",
    [
        ({"models": TWO_MODELS, "engine": {"model": "base"}}, "(top level)", "engine cannot stand beside"),
        (
            {"models": [TWO_MODELS[0], {**TWO_MODELS[1], "engine": {"block_size": 12}}]},
            "models.1.engine.block_size",
            "power of two",
        ),
        ({"models": [{**TWO_MODELS[0], "encoder": {"max_batch_size": 0}}]}, "models.0.encoder", "1"),
        (
            {"models": TWO_MODELS, "http": {"default_beam_size": 5}},
            "http.default_beam_size",
            "models[1].engine.max_num_seqs (4)",
        ),
    ],
)
def test_a_bad_models_section_fails_naming_the_model_and_the_field(args, field, reason):
    with pytest.raises(ConfigError) as failure:
        parse_app_config(args)
    assert field in str(failure.value) and reason in str(failure.value), str(failure.value)


def test_the_app_has_one_diarizer_for_all_its_models_on_cpu_unless_given_a_gpu_and_none_without_the_section():
    from deployments.app import build_whisper_app

    config = parse_app_config(
        {"models": TWO_MODELS, "diarizer": {"num_cpus": 0.5, "autoscaling": {"max_replicas": 3}}}
    )
    ingress = build_whisper_app(config)._bound_deployment
    diarizer = ingress.init_args[2]._bound_deployment
    assert diarizer.name == "WhisperDiarizer" and diarizer.ray_actor_options["num_cpus"] == 0.5
    assert diarizer._deployment_config.autoscaling_config.max_replicas == 3
    assert diarizer.init_args[0].device == "cpu"
    assert parse_app_config({"diarizer": {"num_gpus": 0.25}}).diarizer.device == "cuda"
    assert build_whisper_app(parse_app_config({}))._bound_deployment.init_args[2] is None


def test_the_default_config_diarizes_on_a_cpu_replica_beside_its_models():
    config = parse_app_config(shipped_default_args())
    assert config.diarizer is not None and config.diarizer.device == "cpu"
    assert config.diarizer.num_replicas == 1 and config.diarizer.autoscaling is None


def test_live_partial_passes_take_the_audios_context_by_the_second_on_a_cpu_and_the_full_window_on_cuda():
    config = parse_app_config(default_app_args())
    on_cpu = config.serving(config.default_model).realtime
    assert (on_cpu.partial_context, on_cpu.partial_context_step_s) == ("audio", 1)
    assert on_cpu.partial_context_frames() == list(range(250, 1500, 50)), "5 s to 29 s: what encoders prepare"
    on_cuda = RealtimeOptions().on("cuda")
    assert (on_cuda.partial_context, on_cuda.partial_context_frames()) == ("full_window", [])
    # What the config sets is kept on either device.
    assert RealtimeOptions(partial_context_step_s=10).on("cpu").partial_context_frames() == [500, 1000]
    assert RealtimeOptions(partial_context="full_window").on("cpu").partial_context_frames() == []
    assert RealtimeOptions(partial_context="audio").on("cuda").partial_context_frames() == [500, 1000]
