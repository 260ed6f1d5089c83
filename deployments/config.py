"""The application's configuration: what `serve run configs/<x>.yaml` passes as the app's args.

Validated once, when the app is built, so a typo fails `serve run` with a message naming the
field instead of failing the first request.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from deployments.http_limits import HTTPLimits
from deployments.model_config import MODEL_SECTIONS, ModelConfig, ModelSections
from deployments.replica_options import DiarizerOptions, ReplicaOptions
from engine import context_buckets


class RealtimeOptions(BaseModel):
    """Live transcription sessions on `GET /v1/realtime?intent=transcription` (OpenAI's Realtime API)."""

    model_config = ConfigDict(extra="forbid")

    max_sessions: int = Field(
        64,
        ge=1,
        description="open sessions per ingress replica; new sessions go to a replica with room, and one "
        "that finds every replica full gets an error event and a 1013 close",
    )
    routing_stats_period_s: float = Field(
        1.0,
        gt=0,
        description="how often each ingress replica reports its open sessions to the router that "
        "spreads new ones (deployments/routing.py)",
    )
    final_beam_size: int = Field(
        1,
        ge=1,
        description="beams for each turn's final pass (partial passes stay greedy: they are drafts); "
        "set it to http.default_beam_size for turns to read as the file endpoint's text",
    )
    partial_interval_ms: float = Field(
        500.0,
        ge=50,
        description="how often an open turn's audio so far is transcribed again for partial text, at "
        "most: while every partial slot (max_partial_passes_in_flight) is out, turns wait for one and "
        "take them in turn, so each stream's passes thin out; a turn whose previous pass is still out "
        "or waiting, or whose audio since it held no speech (server VAD), lets the interval go by",
    )
    partial_agreement_s: float = Field(
        2.0,
        ge=0,
        description="a word of partial text is sent once every partial pass over at least this much "
        "of the turn's audio (and at least three passes) agrees on it: longer sends text later and "
        "takes fewer early mishearings into the turn's text, which deltas never retract",
    )
    # 'auto' chooses by the device a model's encoder runs on. On a GPU the full window: a forward of
    # many full windows costs little more than one, and the audio's context did not pay under load
    # there. On a CPU a forward costs what its frames do, and every partial pass over a full window
    # holds the encoder for as long as a final pass takes, so a final pass queues behind it; there
    # the audio's context, in one-second steps (benchmarks/RESULTS.md, bench_realtime.py).
    partial_context: Literal["auto", "audio", "full_window"] = Field(
        "auto",
        description="what a partial pass is encoded over: `audio`, the turn's audio so far (with "
        "`partial_context_pad_s` of silence after it, at least `partial_context_min_s`, rounded up to "
        "`partial_context_step_s`), which costs the encoder and the cross-attention K/V what that audio "
        "costs; `full_window`, a padded 30 s window, as final passes always are; `auto`: `audio` for a "
        "model whose engine runs on a CPU, `full_window` on CUDA",
    )
    partial_context_step_s: int = Field(
        10,
        ge=1,
        le=30,
        description="with partial_context `audio`: contexts are rounded up to whole multiples of this "
        "many seconds (the last to the full window). An encoder forward runs one context, so passes "
        "of different contexts never share one; and the encoder is compiled (and its CUDA graphs "
        "captured) for each context at start-up. Coarser steps share forwards among concurrent "
        "passes, as a GPU wants; 1 costs each pass least where forwards cost what their windows do "
        "(a CPU), and is what a model on a CPU takes unless this is set",
    )
    partial_context_pad_s: float = Field(
        1.0,
        ge=0,
        le=30,
        description="with partial_context `audio`: seconds of the silence after the audio a partial "
        "pass encodes (Whisper drops or garbles the last words of audio that ends at its context's end)",
    )
    partial_context_min_s: float = Field(
        5.0,
        ge=0,
        le=30,
        description="with partial_context `audio`: the shortest context a partial pass is encoded "
        "over, in seconds of audio (shorter ones send the first words later, for no less cost)",
    )
    max_partial_passes_in_flight: int = Field(
        8,
        ge=1,
        description="partial passes out at once across this replica's sessions (one encoder batch); "
        "beyond it turns wait, and a slot that frees goes to the turn longest without a partial pass, "
        "so a final pass (which takes no slot) never queues behind many",
    )
    idle_timeout_s: float = Field(
        120.0, gt=0, description="a session with no client event for this long is closed (code 1000)"
    )
    max_turn_s: float = Field(
        300.0,
        gt=0,
        description="a turn (speech or buffered audio) this long is committed as if speech stopped",
    )
    max_audio_ahead_s: float = Field(
        10.0,
        gt=0,
        description="how far the audio a client appends may run ahead of the wall clock since the "
        "session opened; beyond it the chunk is refused with an error event (clients stream live)",
    )
    fixed_output_tokens: int | None = Field(
        None,
        ge=1,
        description="benchmarks only: every pass (partial and final) decodes exactly this many tokens, "
        "with no fallback, so that random weights (which never stop) cost what speech does; no transcript",
    )

    def on(self, device_type: str) -> RealtimeOptions:
        """These options for a model whose engine runs on ``device_type`` ('cpu' or 'cuda'), with
        what was left to the device chosen: `auto`, and on a CPU an unset partial_context_step_s.
        Options not chosen for a device encode partial passes over the full window."""
        on_cpu = device_type == "cpu"
        update: dict[str, Any] = {}
        if self.partial_context == "auto":
            update["partial_context"] = "audio" if on_cpu else "full_window"
        if on_cpu and "partial_context_step_s" not in self.model_fields_set:
            update["partial_context_step_s"] = 1
        return self.model_copy(update=update)

    @property
    def partial_passes_on_audio(self) -> bool:
        return self.partial_context == "audio"

    def partial_context_frames(self) -> list[int]:
        """The shortened contexts a partial pass may be encoded over, in encoder frames (empty with
        `full_window`): what an encoder prepares for at start-up."""
        if not self.partial_passes_on_audio:
            return []
        settings = (self.partial_context_min_s, self.partial_context_pad_s, self.partial_context_step_s)
        return context_buckets(*settings)[:-1]  # the last is the full window


class AppConfig(ModelSections):
    """The app's configuration. One model: the sections `engine`, `transfer`, `encoder`, `decoder`
    (and `placement`, `served_model_names`) describe it. Several: `models` lists them, each with
    those sections of its own; the top-level ones then read as the default model's."""

    model_config = ConfigDict(extra="forbid")

    served_model_names: list[str] = Field(
        default_factory=lambda: ["whisper-1"],
        description="names clients may send as `model`; the engine's model is always accepted too (with "
        "`models:`, each model's `name` and `aliases` instead)",
    )
    models: list[ModelConfig] = Field(
        default_factory=list,
        description="several models in one app, each with its own engine, transfer, placement, encoder and "
        "decoder; requests choose one by `model` (a name or an alias). Empty: the app serves the one model "
        "the top-level sections describe. Not together with those sections",
    )
    # The ingress is async and mostly waits: let it hold many requests, and shed load itself
    # (http.max_in_flight_requests) so overload answers in OpenAI's error format.
    ingress: ReplicaOptions = Field(
        default_factory=lambda: ReplicaOptions(num_cpus=0.5, max_ongoing_requests=1024),
        description="the deployment that serves HTTP and WebSocket clients",
    )
    http: HTTPLimits = Field(default_factory=HTTPLimits, description="the HTTP API's limits and keys")
    realtime: RealtimeOptions = Field(default_factory=RealtimeOptions, description="live transcription")
    diarizer: DiarizerOptions | None = Field(
        None,
        description="the speaker diarizer deployment, one for the app (who speaks does not depend on the "
        "model); it answers response_format=diarized_json and diarize=true. Absent: no diarizer, and "
        "such requests get a 400. It runs beside the models' replicas under either placement",
    )

    _views: dict[str, AppConfig] = PrivateAttr(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _models_or_one_model(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("models"):
            given = [name for name in MODEL_SECTIONS if name in data]
            if given:
                raise ValueError(
                    f"{', '.join(given)} cannot stand beside `models:`: each model has its own "
                    "sections; move them into the model they describe"
                )
        return data

    @field_validator("served_model_names")
    @classmethod
    def _at_least_one_name(cls, names: list[str]) -> list[str]:
        if not names:
            raise ValueError("served_model_names needs at least one name")
        return names

    @field_validator("models")
    @classmethod
    def _names_are_unique_and_one_is_the_default(cls, models: list[ModelConfig]) -> list[ModelConfig]:
        if not models:
            return models
        owners: dict[str, str] = {}
        for index, model in enumerate(models):
            for position, model_id in enumerate(model.ids):
                where = f"models[{index}]." + ("name" if position == 0 else "aliases")
                if model_id in owners:
                    raise ValueError(
                        f"the id '{model_id}' is given twice ({owners[model_id]} and {where}); "
                        "every model name and alias must choose one model"
                    )
                owners[model_id] = where
        suffixes = [model.deployment_suffix for model in models]
        if len(set(suffixes)) < len(suffixes):
            raise ValueError(
                f"the names {', '.join(model.name for model in models)} give the same deployment name "
                "once characters other than letters, digits, '.', '_' and '-' are replaced; rename one"
            )
        defaults = [model.name for model in models if model.default]
        if len(models) > 1 and not defaults:
            raise ValueError(
                f"no model is the default; mark one of {', '.join(model.name for model in models)} "
                "with `default: true`"
            )
        if len(defaults) > 1:
            raise ValueError(
                f"{', '.join(defaults)} are each marked `default: true`; mark exactly one model the default"
            )
        return models

    @model_validator(mode="after")
    def _one_list_of_models(self) -> "AppConfig":
        """After this, ``models`` lists every model served and the top-level sections are the default
        model's, whichever shape the config had."""
        if not self.models:
            self.models = [
                ModelConfig(
                    name=self.engine.model,
                    aliases=[name for name in self.served_model_names if name != self.engine.model],
                    default=True,
                    placement=self.placement,
                    engine=self.engine,
                    transfer=self.transfer,
                    encoder=self.encoder,
                    decoder=self.decoder,
                )
            ]
            return self
        default = next((model for model in self.models if model.default), self.models[0])
        default.default = True
        self.served_model_names = default.ids
        for section in MODEL_SECTIONS[1:]:
            setattr(self, section, getattr(default, section))
        return self

    @model_validator(mode="after")
    def _ingress_sheds_load_before_serve_does(self) -> "AppConfig":
        http = self.http
        if self.ingress.max_ongoing_requests <= http.max_in_flight_requests + http.max_pending_uploads:
            raise ValueError(
                f"ingress.max_ongoing_requests ({self.ingress.max_ongoing_requests}) must exceed "
                f"http.max_in_flight_requests ({http.max_in_flight_requests}) plus "
                f"http.max_pending_uploads ({http.max_pending_uploads}), so that overload and slow "
                "uploads are answered by the ingress (OpenAI error JSON) rather than by Serve's proxy"
            )
        return self

    @model_validator(mode="after")
    def _default_beams_fit_the_decoder(self) -> "AppConfig":
        several = len(self.models) > 1
        for index, model in enumerate(self.models):
            max_num_seqs = model.engine.max_num_seqs
            seqs = f"models[{index}].engine.max_num_seqs" if several else "engine.max_num_seqs"
            if self.realtime.final_beam_size > min(self.http.max_beam_size, max_num_seqs):
                raise ValueError(
                    f"realtime.final_beam_size ({self.realtime.final_beam_size}) exceeds http.max_beam_size "
                    f"({self.http.max_beam_size}) or {seqs} ({max_num_seqs})"
                )
            if self.http.default_beam_size > min(self.http.max_beam_size, max_num_seqs):
                raise ValueError(
                    f"http.default_beam_size ({self.http.default_beam_size}) exceeds the largest beam "
                    f"this app decodes: http.max_beam_size ({self.http.max_beam_size}) and {seqs} "
                    f"({max_num_seqs}), since each beam runs as a sequence"
                )
        return self

    @property
    def largest_beam_size(self) -> int:
        """The largest beam_size (or best_of) a request may ask for: each beam is a decoder sequence
        (of the default model; of the model served, in ``serving(model)``'s view)."""
        return min(self.http.max_beam_size, self.engine.max_num_seqs)

    @property
    def colocated(self) -> bool:
        return self.placement == "colocated"

    @property
    def default_model(self) -> ModelConfig:
        return next(model for model in self.models if model.default)

    @property
    def accepted_model_names(self) -> list[str]:
        """Every id a request may send as `model`, model by model: each name, then its aliases."""
        return [model_id for model in self.models for model_id in model.ids]

    def model_named(self, model_id: str) -> ModelConfig | None:
        """The model a request's `model` chooses (a name or an alias), or None."""
        return next((model for model in self.models if model_id in model.ids), None)

    def serving(self, model: ModelConfig) -> AppConfig:
        """This config as one model's replicas see it: the one-model shape, with that model's
        sections and the app's own (http, ingress, and realtime as chosen for the model's device)."""
        view = self._views.get(model.name)
        if view is None:
            view = self.model_copy(
                update={
                    "served_model_names": model.ids,
                    "placement": model.placement,
                    "engine": model.engine,
                    "transfer": model.transfer,
                    "encoder": model.encoder,
                    "decoder": model.decoder,
                    "models": [model.model_copy(update={"default": True})],
                    "realtime": self.realtime.on(model.engine.torch_device.type),
                }
            )
            view._views = {}
            self._views[model.name] = view
        return view


class ConfigError(ValueError):
    """The app's configuration is invalid; the message lists every bad field and why."""


def validation_problems(error: ValidationError) -> str:
    """One indented line per bad field: its dotted path and what is wrong with it."""
    return "\n".join(
        f"  {'.'.join(str(part) for part in item['loc']) or '(top level)'}: {item['msg']}"
        for item in error.errors()
    )


def parse_app_config(args: dict[str, Any] | None) -> AppConfig:
    try:
        return AppConfig.model_validate(args or {})
    except ValidationError as error:
        raise ConfigError(f"invalid whisper-disagg app config:\n{validation_problems(error)}") from None
