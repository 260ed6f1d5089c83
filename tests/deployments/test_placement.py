"""The placement planner (deployments/placement): its recommendation follows the arithmetic of its
docstring on made-up profiles, a bad file is refused with the field named, and a profile the
calibration script measures here plans."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from deployments.placement.__main__ import main as plan_command
from deployments.placement.inputs import (
    CalibrationProfile,
    PlanInputError,
    TrafficKind,
    TrafficMix,
    load_mix,
    load_profile,
)
from deployments.placement.planner import PlanSettings, plan
from tests.support.paths import CONFIGS_DIR, REPO_ROOT

# An encoder window costs 0.01 s at batch 4 (0.02 s alone); a token 0.0005 s at 10 rows (0.002 s alone).
PROFILE = CalibrationProfile(encoder_batch_s={1: 0.02, 4: 0.04}, decoder_step_s={1: 0.002, 10: 0.005})


def files(share: float, audio_s: float = 20, tokens_per_window: float = 100, name: str = "files"):
    return TrafficKind(name=name, share=share, audio_s=audio_s, tokens_per_window=tokens_per_window)


def best_split(mix: TrafficMix, gpus: int, profile: CalibrationProfile = PROFILE):
    splits = [
        prediction for prediction in plan(profile, mix, gpus).layouts if not prediction.layout.colocated_gpus
    ]
    return max(splits, key=lambda prediction: prediction.goodput_per_s).layout


def test_an_encoder_heavy_mix_gets_more_encoder_gpus_than_a_decoder_heavy_mix():
    live = TrafficKind(name="live", share=1, audio_s=60, tokens_per_window=10, partial_interval_s=0.5)
    long_files = files(1, audio_s=600, tokens_per_window=400, name="long files")
    encoder_heavy = TrafficMix(kinds=[live.model_copy(update={"share": 9}), long_files])
    decoder_heavy = TrafficMix(kinds=[live, long_files.model_copy(update={"share": 9})])
    encoder_side = best_split(encoder_heavy, gpus=8)
    decoder_side = best_split(decoder_heavy, gpus=8)
    assert encoder_side.encoder_gpus > decoder_side.encoder_gpus
    assert encoder_side.encoder_gpus > encoder_side.decoder_gpus
    assert decoder_side.decoder_gpus > decoder_side.encoder_gpus


def test_a_split_is_recommended_only_when_sharing_a_gpu_costs_more_than_pulling_k_v():
    mix = TrafficMix(kinds=[files(1, tokens_per_window=20)])  # E 0.01 s, D 0.01 s: a 1:1 split fits it
    assert plan(PROFILE, mix, 2).recommended.layout.colocated_gpus == 2  # a tie goes to colocated
    slowed = plan(PROFILE, mix, 2, PlanSettings(colocated_slowdown=1.2)).recommended
    assert (slowed.layout.encoder_gpus, slowed.layout.decoder_gpus) == (1, 1)
    assert slowed.goodput_per_s == pytest.approx(0.85 * 1 / 0.01)


def test_the_predicted_goodput_is_the_hand_arithmetic():
    # One window a request: E = 0.01 s, D = 100 tokens x 0.0005 s = 0.05 s, T = 0.002 s.
    profile = PROFILE.model_copy(update={"kv_transfer_s_per_window": 0.002})
    result = plan(profile, TrafficMix(kinds=[files(1)]), 2)
    assert (result.speeds.encoder_batch, result.speeds.decode_rows) == (4, 10)
    assert result.encoder_s_per_request == pytest.approx(0.01)
    assert result.decoder_s_per_request == pytest.approx(0.05)
    assert result.transfer_s_per_request == pytest.approx(0.002)
    colocated, split = result.layouts
    assert colocated.goodput_per_s == pytest.approx(0.85 * 2 / (0.01 + 0.05))
    assert split.goodput_per_s == pytest.approx(0.85 * min(1 / 0.01, 1 / (0.05 + 0.002)))
    assert split.bound_by == "decoder"
    assert split.utilisation_at(split.goodput_per_s) == pytest.approx((0.85 * 0.01 / 0.052, 0.85))


def test_a_live_stream_counts_its_partial_passes_on_both_sides():
    live = TrafficKind(name="live", share=1, audio_s=60, tokens_per_window=40, partial_interval_s=1.0)
    (load,) = plan(PROFILE, TrafficMix(kinds=[live]), 1).kinds
    # Two final windows and 60 partial passes, each decoding half a window's tokens on average.
    assert load.windows_encoded == pytest.approx(2 + 60)
    assert load.tokens_decoded == pytest.approx(2 * 40 + 60 * 20)
    assert load.encoder_s == pytest.approx(62 * 0.01)
    assert load.decoder_s == pytest.approx(1280 * 0.0005)


def test_a_mix_that_fits_one_gpus_both_sides_is_served_colocated_at_its_arithmetic():
    profile = PROFILE.model_copy(update={"kv_transfer_s_per_window": 0.002})
    short = files(1).model_copy(update={"share": None, "rate_per_s": 6.0})  # E 0.06 + D 0.3 of a GPU
    result = plan(profile, TrafficMix(kinds=[short]), 2)
    best = result.recommended
    assert best.layout.colocated_gpus == 2
    assert result.given_rate_per_s == 6.0
    assert best.utilisation_at(6.0) == pytest.approx((6 * 0.01 / 2, 6 * 0.05 / 2))
    assert sum(best.utilisation_at(6.0)) < 0.85 / 2  # one GPU's both sides would hold it
    assert best.goodput_per_s == pytest.approx(0.85 * 2 / 0.06)


def test_the_speeds_are_the_most_efficient_profiled_sizes_under_the_caps():
    capped = plan(
        PROFILE, TrafficMix(kinds=[files(1)]), 1, PlanSettings(max_encoder_batch=2, max_decode_rows=9)
    )
    assert (capped.speeds.encoder_batch, capped.speeds.encoder_s_per_window) == (1, 0.02)
    assert (capped.speeds.decode_rows, capped.speeds.decoder_s_per_token) == (1, 0.002)
    unbatched = PROFILE.model_copy(update={"decoder_step_s": {10: 0.005}})
    with pytest.raises(PlanInputError, match=r"max_decode_rows is 9, below every size the profile measured"):
        plan(unbatched, TrafficMix(kinds=[files(1)]), 1, PlanSettings(max_decode_rows=9))


def test_a_bad_profile_file_is_refused_naming_the_field(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"encoder_batch_s": {"8": 0.1}, "decoder_step_s": {"16": -0.004}}))
    with pytest.raises(PlanInputError) as refused:
        load_profile(path)
    assert str(path) in str(refused.value) and "decoder_step_s.16" in str(refused.value)
    path.write_text(json.dumps({"decoder_step_s": {"16": 0.004}}))
    with pytest.raises(PlanInputError, match="encoder_batch_s: Field required"):
        load_profile(path)
    path.write_text(json.dumps({"encoder_batch_s": {"eight": 0.1}, "decoder_step_s": {"16": 0.004}}))
    with pytest.raises(PlanInputError, match="encoder_batch_s.eight"):
        load_profile(path)


def test_a_mix_that_weighs_a_kind_two_ways_is_refused_naming_the_kind(tmp_path):
    path = tmp_path / "mix.yaml"
    path.write_text("kinds:\n  - {name: short, share: 1, rate_per_s: 2, audio_s: 8, tokens_per_window: 30}\n")
    with pytest.raises(PlanInputError, match="kinds.short: give exactly one of share and rate_per_s"):
        load_mix(path)


def test_the_plan_command_prints_every_layout_and_the_recommendation_for_the_example_files(capsys):
    example = CONFIGS_DIR / "placement"
    code = plan_command(
        ["--profile", str(example / "example-profile.json"), "--mix", str(example / "example-mix.yaml")]
        + ["--gpus", "3"]
    )
    printed = capsys.readouterr().out
    assert code == 0
    assert "MADE-UP" in printed
    for label in ("colocated x3", "split 1:2", "split 2:1", "Recommended: "):
        assert label in printed


def test_the_plan_command_names_the_bad_field_and_exits_2(tmp_path, capsys):
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"encoder_batch_s": {}, "decoder_step_s": {"1": 0.01}}))
    mix = CONFIGS_DIR / "placement" / "example-mix.yaml"
    assert plan_command(["--profile", str(profile), "--mix", str(mix), "--gpus", "2"]) == 2
    assert "encoder_batch_s" in capsys.readouterr().err


@pytest.mark.slow
def test_a_profile_the_calibration_script_measures_on_cpu_plans(tmp_path):
    out = tmp_path / "tiny-cpu.json"
    subprocess.run(
        [sys.executable, str(REPO_ROOT / "benchmarks" / "calibrate_placement.py"), "--model", "tiny.en"]
        + ["--device", "cpu", "--encoder-batches", "1,2", "--decoder-rows", "1,2", "--tokens", "8"]
        + ["--seconds", "0.05", "--kv-transfer-ms", "1", "--out", str(out)],
        cwd=REPO_ROOT,
        check=True,
        capture_output=True,
        timeout=600,
    )
    profile = load_profile(out)
    assert set(profile.encoder_batch_s) == {1, 2} and set(profile.decoder_step_s) == {1, 2}
    assert profile.kv_transfer_s_per_window == pytest.approx(0.001)
    result = plan(profile, load_mix(CONFIGS_DIR / "placement" / "example-mix.yaml"), 2)
    assert [prediction.layout.label for prediction in result.layouts] == ["colocated x2", "split 1:1"]
    assert all(prediction.goodput_per_s > 0 for prediction in result.layouts)
