"""What a live turn's partial-text policy sends, replayed offline: how close the turn's text (the
deltas joined) stays to its final pass and to the reference, and how late words are sent.

A turn as the server sees it (0.5 s of silence, the speech, 0.5 s of silence) is transcribed by a
model (the bundled tiny.en unless ``--model``) as a partial pass would be, cut every 0.1 s of audio
from 1.5 s on, and as the final pass would be. Those texts are then replayed through
``LocalAgreement`` for passes every N seconds of audio (each start offset on the 0.1 s grid) and
each policy:
- turns differing: the turn's text is not its final pass's (a word sent early was wrong);
- WER of the turns' texts and of their final passes against the reference transcripts;
- lag: for each word, when it was sent (its pass's audio, or the turn's end for the final pass's)
  after the time from which every later cut's text held it.

    python benchmarks/live_agreement.py --record
    python benchmarks/live_agreement.py --model /path/to/whisper-base --device cuda --language en
Long turns are jfk and runs of three speech-set clips with 0.25 s between them; ``--short`` adds the
single clips. The transcripts are cached (``--cache``), with what made them (the model, its device,
the cut grid and the partial passes' token caps): a run that differs in any of them transcribes
again, and the policies replay in seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.recording import markdown_table, record  # noqa: E402
from deployments.orchestration.live_turn import PARTIAL_MIN_AUDIO_S, PARTIAL_TOKENS_BASE, PARTIAL_TOKENS_PER_S  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.model.audio import SAMPLE_RATE, load_audio_file  # noqa: E402
from engine.model.loading import load_model  # noqa: E402
from engine.transcribe.agreement import LocalAgreement  # noqa: E402
from engine.transcribe.evaluation import load_manifest, word_error_rate  # noqa: E402
from engine.transcribe.offline import Transcriber  # noqa: E402
from engine.types import DecodeOptions, FallbackOptions  # noqa: E402

SPEECH_DIR = Path(__file__).resolve().parents[1] / "tests" / "data" / "speech"
CUT_S = 0.1
PADDING_S = 0.5
GAP_S = 0.25
# LocalAgreement's span_s for each policy (passes=3 in each)
POLICIES = {
    "3 passes": 0.0,
    "3 passes over 1.5 s": 1.5,
    "3 passes over 2.0 s": 2.0,
    "3 passes over 2.5 s": 2.5,
}


def _turns(short: bool) -> dict[str, list[str]]:
    clips = [clip for clip in load_manifest(SPEECH_DIR) if clip.id.startswith(("tts", "osr72"))]
    turns = {"jfk": ["jfk"]}
    for first in range(0, 24, 3):
        ids = [clip.id for clip in clips[first : first + 3]]
        turns["+".join(ids)] = ids
    if short:
        turns |= {clip.id: [clip.id] for clip in clips}
    return turns


def _transcribe_turns(
    turns: dict[str, list[str]], cache: Path, config: EngineConfig, language: str | None
) -> dict[str, dict]:
    made_by = {
        "model": config.model,
        "device": config.device,
        "language": language,
        "cut_s": CUT_S,
        "partial_passes": [PARTIAL_MIN_AUDIO_S, PARTIAL_TOKENS_BASE, PARTIAL_TOKENS_PER_S],
    }
    cached = json.loads(cache.read_text()) if cache.exists() else {}
    texts = cached.get("texts", {}) if cached.get("made_by") == made_by else {}
    missing = [name for name in turns if name not in texts]
    if not missing:
        return texts
    transcriber = Transcriber(loaded=load_model(config))
    paths = {clip.id: clip.path for clip in load_manifest(SPEECH_DIR)}
    silence, gap = np.zeros(int(PADDING_S * SAMPLE_RATE)), np.zeros(int(GAP_S * SAMPLE_RATE))
    for name in missing:
        pieces = [silence]
        for index, clip_id in enumerate(turns[name]):
            pieces += [gap] if index else []
            pieces.append(load_audio_file(paths[clip_id]))
        audio = np.concatenate([*pieces, silence]).astype(np.float32)
        final_options = DecodeOptions(language=language, fallback=FallbackOptions())
        final = transcriber.transcribe([audio], final_options)[0].text
        partials = {}
        for cut in range(round(PARTIAL_MIN_AUDIO_S / CUT_S), int(len(audio) / SAMPLE_RATE / CUT_S) + 1):
            heard_s = cut * CUT_S
            max_tokens = int(PARTIAL_TOKENS_BASE + PARTIAL_TOKENS_PER_S * heard_s)
            options = DecodeOptions(language=language, max_tokens=max_tokens)
            partials[cut] = transcriber.transcribe([audio[: int(heard_s * SAMPLE_RATE)]], options)[0].text
        texts[name] = {"final": final, "partials": partials, "duration_s": len(audio) / SAMPLE_RATE}
        cache.write_text(json.dumps({"made_by": made_by, "texts": texts}))
        print(f"{name}: {len(partials)} cuts", flush=True)
    return texts


def _replay(turn: dict, every: int, offset: int, span_s: float) -> tuple[str, list[float]]:
    """The turn's text for passes every ``every`` cuts from ``offset``, and each word's lag."""
    partials = {int(cut): text for cut, text in turn["partials"].items()}
    agreement, sent_at = LocalAgreement(span_s=span_s), []
    for cut in range(min(partials) + offset, max(partials) + 1, every):
        delta = agreement.update(partials[cut], cut * CUT_S)
        sent_at += [cut * CUT_S] * len(delta.split())
    agreement.finish_window(turn["final"])
    words = agreement.committed
    sent_at += [turn["duration_s"]] * (len(words) - len(sent_at))
    lags = []
    for index, sent_s in enumerate(sent_at):
        held_since_s = turn["duration_s"]
        for cut in sorted(partials, reverse=True):
            if partials[cut].split()[: index + 1] != words[: index + 1]:
                break
            held_since_s = cut * CUT_S
        lags.append(max(0.0, sent_s - held_since_s))
    return agreement.text, lags


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--short", action="store_true", help="also the single clips as turns")
    parser.add_argument("--every-s", type=float, nargs="+", default=[0.2, 0.5, 0.8])
    parser.add_argument("--model", default="tiny.en", help="a bundled name or a model folder")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--language", help="the passes' language (default: detected, as a session without one)"
    )
    parser.add_argument("--cache", type=Path, default=Path("/tmp/live_agreement_texts.json"))
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()
    turns = _turns(args.short)
    config = EngineConfig(model=args.model, device=args.device)
    texts = _transcribe_turns(turns, args.cache, config, args.language)
    references = {clip.id: clip.text for clip in load_manifest(SPEECH_DIR)}
    rows = []
    for every_s in args.every_s:
        every = round(every_s / CUT_S)
        for policy, span_s in POLICIES.items():
            live, finals, refs, lags = [], [], [], []
            for name, clip_ids in turns.items():
                for offset in range(every):
                    text, turn_lags = _replay(texts[name], every, offset, span_s)
                    live.append(text)
                    finals.append(texts[name]["final"])
                    refs.append(" ".join(references[clip_id] for clip_id in clip_ids))
                    lags += turn_lags
            differing = sum(text != final.strip() for text, final in zip(live, finals))
            rows.append(
                [
                    f"{every_s:g}",
                    policy,
                    f"{differing}/{len(live)}",
                    f"{100 * word_error_rate(refs, live):.2f}%",
                    f"{100 * word_error_rate(refs, finals):.2f}%",
                    f"{np.mean(lags):.2f}",
                ]
            )
    headers = [
        "passes every s",
        "policy",
        "turns differing from the final pass",
        "WER live",
        "WER final",
        "lag s",
    ]
    table = markdown_table(headers, rows)
    print(table)
    if args.record:
        record(
            "Live partial text: passes that agree over seconds of audio, not a count of passes",
            table,
            f"{len(turns)} turns ({Path(args.model).name}, {args.device}), each replayed from every start "
            "offset.",
        )


if __name__ == "__main__":
    main()
