"""`python -m deployments.placement --profile P --mix M --gpus N`: which layout serves a mix best.

Reads a calibration profile (benchmarks/calibrate_placement.py writes one) and a traffic mix, and
prints every layout's predicted goodput on N GPUs with the recommendation and its arithmetic
(the model: deployments/placement/planner.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from deployments.placement.inputs import PlanInputError, load_mix, load_profile
from deployments.placement.planner import PlanSettings, plan
from deployments.placement.report import render


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m deployments.placement",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--profile", type=Path, required=True, help="a calibration profile (JSON or YAML)")
    parser.add_argument("--mix", type=Path, required=True, help="a traffic mix (JSON or YAML)")
    parser.add_argument("--gpus", type=int, required=True)
    defaults = {name: field.default for name, field in PlanSettings.model_fields.items()}
    parser.add_argument(
        "--ceiling", type=float, default=defaults["utilisation_ceiling"], help="the busiest a GPU may be"
    )
    parser.add_argument("--max-encoder-batch", type=int, default=None, help="default: the profile's largest")
    parser.add_argument("--max-decode-rows", type=int, default=None, help="default: the profile's largest")
    parser.add_argument(
        "--colocated-slowdown",
        type=float,
        default=defaults["colocated_slowdown"],
        help="GPU time both sides take more when sharing (a colocated run's step time over the engine "
        "alone's on the same card)",
    )
    args = parser.parse_args(argv)
    try:
        settings = PlanSettings(
            utilisation_ceiling=args.ceiling,
            max_encoder_batch=args.max_encoder_batch,
            max_decode_rows=args.max_decode_rows,
            colocated_slowdown=args.colocated_slowdown,
        )
        profile, mix = load_profile(args.profile), load_mix(args.mix)
        print(render(plan(profile, mix, args.gpus, settings), profile, mix))
    except (PlanInputError, ValueError) as error:
        print(f"python -m deployments.placement: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
