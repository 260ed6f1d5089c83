"""The ingress's table of models, without Ray: ids resolve to their model, and what a model's
decoders answer about a request's options turns into an answer that names the model. The app over
HTTP with two real models is tests/deployments/test_models.py."""

from __future__ import annotations

import asyncio

import pytest
from ray.serve._private.common import DeploymentID
from ray.serve.exceptions import DeploymentUnavailableError

from deployments.http.errors import APIError
from deployments.http.option_checks import AcceptedOptions
from deployments.served_models import ServedModel, ServedModels
from engine.errors import RequestRejectedError
from engine.types import DecodeOptions


def _model(name: str, aliases: tuple[str, ...] = (), answer: Exception | None = None) -> ServedModel:
    """A model whose decoders answer every options check with ``answer`` (None: accepted): a
    rejection is returned, as a decoder replica returns it; any other error is raised."""

    async def ask(options: DecodeOptions) -> RequestRejectedError | None:
        if answer is not None and not isinstance(answer, RequestRejectedError):
            raise answer
        return answer

    return ServedModel(name, (name, *aliases), None, AcceptedOptions(ask))


def test_names_and_aliases_choose_their_model_and_the_default_is_the_one_named():
    tiny, base = _model("tiny.en", ("whisper-1",)), _model("base")
    models = ServedModels([tiny, base], "tiny.en")
    assert models.ids == ["tiny.en", "whisper-1", "base"]
    assert (models.named("whisper-1"), models.named("base"), models.named("whisper-9")) == (tiny, base, None)
    assert models.default is tiny


def test_a_translation_an_english_only_model_rejects_is_a_400_naming_the_model():
    english_only = RequestRejectedError("model is English-only; it cannot translate", param="task")
    model = _model("tiny.en", answer=english_only)
    with pytest.raises(APIError) as refused:
        asyncio.run(model.check_options(DecodeOptions(task="translate")))
    assert (refused.value.status, refused.value.param) == (400, "model")
    assert "'tiny.en' is English-only" in refused.value.message


def test_other_rejections_reach_the_client_as_the_decoder_gave_them():
    unknown_language = RequestRejectedError("unknown language 'xx'", param="language")
    model = _model("base", answer=unknown_language)
    with pytest.raises(RequestRejectedError) as refused:
        asyncio.run(model.check_options(DecodeOptions(language="xx")))
    assert refused.value is unknown_language


def test_a_model_whose_deployment_failed_to_start_is_a_503_naming_it():
    failed = DeploymentUnavailableError(DeploymentID(name="WhisperDecoder-base", app_name="whisper"))
    with pytest.raises(APIError) as unavailable:
        asyncio.run(_model("base", answer=failed).check_options(DecodeOptions()))
    error = unavailable.value
    assert (error.status, error.code, error.param) == (503, "model_unavailable", "model")
    assert "'base' is unavailable" in error.message and error.retry_after_s
