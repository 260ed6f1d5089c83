"""Synthetic speech whose transcript hangs on spelling: rare names, product names and jargon,
spoken by espeak-ng the way a person says them (``spoken``: a phonetic spelling) while the
reference (``text``) spells them as their owners do.

``write_clips`` makes FOLDER/<id>.flac (16 kHz mono) and FOLDER/keyword_manifest.jsonl
(manifest.jsonl's fields, and each clip's ``keywords``); it needs espeak-ng and sox.
benchmarks/bench_keywords.py runs it. tests/data/speech holds kw_siobhan, made this way, for the
keywords tests: in a manifest of its own, since the tests and benchmarks that score the English
clips of manifest.jsonl are not about spelling names.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class KeywordClip:
    id: str
    spoken: str  # what espeak-ng reads: the terms spelled as they sound
    text: str  # the reference transcript: the terms spelled as given in ``keywords``
    keywords: tuple[str, ...]
    voice: str  # espeak-ng voice
    speed_wpm: int

    def manifest_entry(self, duration_s: float) -> dict:
        return {
            "id": self.id,
            "audio": f"{self.id}.flac",
            "text": self.text,
            "keywords": list(self.keywords),
            "duration_s": round(duration_s, 2),
            "source": f"espeak-ng voice {self.voice} speed {self.speed_wpm} (synthetic), reading "
            f'"{self.spoken}"',
            "license": "generated",
        }


CLIPS: tuple[KeywordClip, ...] = (
    KeywordClip(
        "kw_siobhan",
        "Please forward the report to Shivawn before lunch.",
        "Please forward the report to Siobhan before lunch.",
        ("Siobhan",),
        "en-us",
        160,
    ),
    KeywordClip(
        "kw_niamh",
        "Our new designer, Neev, starts on Monday.",
        "Our new designer, Niamh, starts on Monday.",
        ("Niamh",),
        "en-gb",
        150,
    ),
    KeywordClip(
        "kw_saoirse",
        "Sersha booked the meeting room for three o'clock.",
        "Saoirse booked the meeting room for three o'clock.",
        ("Saoirse",),
        "en-us+f2",
        165,
    ),
    KeywordClip(
        "kw_tadhg",
        "The contract was signed by Tyg Oh Sullivan yesterday.",
        "The contract was signed by Tadhg O'Sullivan yesterday.",
        ("Tadhg O'Sullivan",),
        "en-gb+m3",
        145,
    ),
    KeywordClip(
        "kw_wojciech",
        "Ask Voy check to review the budget tomorrow.",
        "Ask Wojciech to review the budget tomorrow.",
        ("Wojciech",),
        "en-us+m1",
        160,
    ),
    KeywordClip(
        "kw_nginx",
        "We put the service behind engine x on every server.",
        "We put the service behind Nginx on every server.",
        ("Nginx",),
        "en-us",
        160,
    ),
    KeywordClip(
        "kw_postgresql",
        "The logs are stored in post gress Q L and read every hour.",
        "The logs are stored in PostgreSQL and read every hour.",
        ("PostgreSQL",),
        "en-gb",
        150,
    ),
    KeywordClip(
        "kw_xochitl",
        "Soe cheel presented the quarterly results to the board.",
        "Xochitl presented the quarterly results to the board.",
        ("Xochitl",),
        "en-us+f2",
        165,
    ),
    KeywordClip(
        "kw_qdrant",
        "The vectors live in quadrant, not in the main database.",
        "The vectors live in Qdrant, not in the main database.",
        ("Qdrant",),
        "en-gb+m3",
        145,
    ),
    KeywordClip(
        "kw_vercel",
        "Our front end is hosted on ver sell since last spring.",
        "Our front end is hosted on Vercel since last spring.",
        ("Vercel",),
        "en-us+m1",
        160,
    ),
    KeywordClip(
        "kw_caoimhe",
        "Keeva and Eefa will lead the workshop on Friday.",
        "Caoimhe and Aoife will lead the workshop on Friday.",
        ("Caoimhe", "Aoife"),
        "en-us",
        160,
    ),
    KeywordClip(
        "kw_kubectl",
        "Run cube control to list the pods in the cluster.",
        "Run kubectl to list the pods in the cluster.",
        ("kubectl",),
        "en-gb",
        150,
    ),
    KeywordClip(
        "kw_nguyen",
        "Doctor Win prescribed a new medication for the cough.",
        "Doctor Nguyen prescribed a new medication for the cough.",
        ("Nguyen",),
        "en-us+f2",
        165,
    ),
    KeywordClip(
        "kw_crispr",
        "The crisper experiment failed twice in the lab.",
        "The CRISPR experiment failed twice in the lab.",
        ("CRISPR",),
        "en-gb+m3",
        145,
    ),
    KeywordClip(
        "kw_grzegorz",
        "Gzheh gosh fixed the login bug last night.",
        "Grzegorz fixed the login bug last night.",
        ("Grzegorz",),
        "en-us+m1",
        160,
    ),
    KeywordClip(
        "kw_joaquin",
        "Meet Wah keen at the station at noon.",
        "Meet Joaquin at the station at noon.",
        ("Joaquin",),
        "en-us",
        160,
    ),
)


def make_clip(clip: KeywordClip, folder: Path) -> Path:
    """Speak ``clip.spoken`` with espeak-ng and store it as 16 kHz mono FLAC in ``folder``."""
    path = folder / f"{clip.id}.flac"
    with tempfile.NamedTemporaryFile(suffix=".wav") as wav:
        subprocess.run(
            ["espeak-ng", "-v", clip.voice, "-s", str(clip.speed_wpm), "-w", wav.name, clip.spoken],
            check=True,
        )
        # -D: no dither, so the same clip comes out sample for sample on every run (dither's
        # one-bit noise is enough to flip a borderline transcript).
        subprocess.run(["sox", "-D", wav.name, "-r", "16000", "-c", "1", "-b", "16", str(path)], check=True)
    return path


def duration_s(path: Path) -> float:
    return float(subprocess.run(["soxi", "-D", str(path)], check=True, capture_output=True, text=True).stdout)


def write_clips(folder: Path, ids: list[str] | None = None) -> list[KeywordClip]:
    """Make the clips (those of ``ids``, or all) and their manifest in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    chosen = [clip for clip in CLIPS if not ids or clip.id in ids]
    with (folder / "keyword_manifest.jsonl").open("w") as manifest:
        for clip in chosen:
            path = make_clip(clip, folder)
            manifest.write(json.dumps(clip.manifest_entry(duration_s(path))) + "\n")
    return chosen
