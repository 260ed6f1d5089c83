"""A plan as text: the speeds used, what each kind of request asks of each side, every layout's
utilisations and goodput, and the recommendation with its arithmetic written out."""

from __future__ import annotations

from deployments.placement.inputs import CalibrationProfile, TrafficMix
from deployments.placement.planner import LayoutPrediction, Plan


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(row) + " |" for row in rows),
    ]


def _arithmetic(plan: Plan, prediction: LayoutPrediction) -> str:
    """The goodput formula with the plan's numbers in it."""
    ceiling = plan.settings.utilisation_ceiling
    layout = prediction.layout
    work = f"E {plan.encoder_s_per_request:.4g} s, D {plan.decoder_s_per_request:.4g} s"
    if layout.colocated_gpus:
        slowdown = plan.settings.colocated_slowdown
        return (
            f"{ceiling:g} x {layout.colocated_gpus} GPU / (s x (E + D)) = {ceiling:g} x "
            f"{layout.colocated_gpus} / ({slowdown:g} x ({plan.encoder_s_per_request:.4g} + "
            f"{plan.decoder_s_per_request:.4g})) = "
            f"{prediction.goodput_per_s:.4g} requests/s ({work})"
        )
    return (
        f"{ceiling:g} x min(e / E, d / (D + T)) = {ceiling:g} x min({layout.encoder_gpus} / "
        f"{plan.encoder_s_per_request:.4g}, {layout.decoder_gpus} / ({plan.decoder_s_per_request:.4g} + "
        f"{plan.transfer_s_per_request:.4g})) = {prediction.goodput_per_s:.4g} requests/s "
        f"({work}, T {plan.transfer_s_per_request:.4g} s)"
    )


def render(plan: Plan, profile: CalibrationProfile, mix: TrafficMix) -> str:
    speeds, ceiling = plan.speeds, plan.settings.utilisation_ceiling
    lines = [
        f"Profile: {profile.model or 'a model'} on {profile.device or 'a device'}"
        + (f" ({profile.note})" if profile.note else ""),
        f"Mix: {mix.note}" if mix.note else "Mix:",
        f"Speeds: encoder {speeds.encoder_s_per_window:.4g} s a window (batch {speeds.encoder_batch}); "
        f"decoder {speeds.decoder_s_per_token:.4g} s a token ({speeds.decode_rows} rows a step); "
        f"K/V pull {speeds.kv_transfer_s_per_window:.4g} s a window when apart",
        "",
        "What one request asks of each side (GPU-seconds):",
    ]
    kind_rows = [
        [
            kind.name,
            f"{kind.fraction:.3f}",
            f"{kind.windows_encoded:.2f}",
            f"{kind.tokens_decoded:.1f}",
            f"{kind.encoder_s:.4g}",
            f"{kind.decoder_s:.4g}",
            f"{kind.transfer_s:.4g}",
        ]
        for kind in plan.kinds
    ]
    kind_rows.append(
        [
            "an average arrival (E, D, T)",
            "1",
            f"{sum(kind.fraction * kind.windows_encoded for kind in plan.kinds):.2f}",
            f"{sum(kind.fraction * kind.tokens_decoded for kind in plan.kinds):.1f}",
            f"{plan.encoder_s_per_request:.4g}",
            f"{plan.decoder_s_per_request:.4g}",
            f"{plan.transfer_s_per_request:.4g}",
        ]
    )
    lines += _table(
        ["kind", "of arrivals", "windows encoded", "tokens decoded", "encoder s", "decoder s", "K/V pull s"],
        kind_rows,
    )
    header = [
        "layout",
        "goodput requests/s",
        "encoder utilisation at goodput",
        "decoder utilisation at goodput",
        "bound by",
    ]
    if plan.given_rate_per_s is not None:
        header += [f"utilisation at the mix's {plan.given_rate_per_s:.4g}/s (encoder, decoder)", "fits"]
    layout_rows = []
    for prediction in plan.layouts:
        encoder, decoder = prediction.utilisation_at(prediction.goodput_per_s)
        row = [
            prediction.layout.label,
            f"{prediction.goodput_per_s:.4g}",
            f"{encoder:.3f}",
            f"{decoder:.3f}",
            prediction.bound_by,
        ]
        if plan.given_rate_per_s is not None:
            encoder, decoder = prediction.utilisation_at(plan.given_rate_per_s)
            fits = prediction.goodput_per_s >= plan.given_rate_per_s
            row += [f"{encoder:.3f}, {decoder:.3f}", "yes" if fits else "no"]
        layout_rows.append(row)
    lines += ["", f"Layouts on {plan.gpus} GPU(s), every GPU at most {ceiling:g} busy:"]
    lines += _table(header, layout_rows)
    best = plan.recommended
    lines += ["", f"Recommended: {best.layout.label}: goodput {_arithmetic(plan, best)}"]
    lines += [
        f"  {kind.name}: {kind.fraction * best.goodput_per_s:.4g} arriving a second"
        + (
            f", {kind.fraction * best.goodput_per_s * mix_kind.audio_s:.4g} streams open at once"
            if mix_kind.partial_interval_s is not None
            else ""
        )
        for kind, mix_kind in zip(plan.kinds, mix.kinds)
    ]
    return "\n".join(lines)
