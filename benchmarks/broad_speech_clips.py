"""Make the broad speech set (tests/data/broad_speech): sentences written for it, spoken by many
espeak-ng voices at many rates and pitches, at many levels, some through a telephone band or a
room's reverberation, and with noise added as the set is read.

Each sentence is spoken by three voices; a voice is an espeak-ng accent with a variant (its
formants, breathiness and pitch range). A third of the voices are held out: their utterances form
the ``held_out`` split, which no tuning decision looks at (tests/support/speech.py reads the
splits). Noise is not stored: each manifest entry names a colour, a signal-to-noise ratio and a seed,
and engine.transcribe.evaluation.clip_samples adds it when the clip is read, because noise does
not compress and the set must stay small enough to live in the repository.

    python benchmarks/broad_speech_clips.py [--folder tests/data/broad_speech]

Needs espeak-ng and sox; writes FOLDER/<id>.flac (16 kHz mono) and FOLDER/manifest.jsonl, and
prints how many utterances and voices it made and their size. The same command makes the same files
(seeded choices, no dither).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FOLDER = Path(__file__).resolve().parents[1] / "tests" / "data" / "broad_speech"
VOICES_PER_SENTENCE = 3
HELD_OUT_EVERY = 3  # every third voice (in VOICES' order) is held out

# espeak-ng voices: an accent (a language file) with a variant, none of them a voice of the tts_*
# clips in tests/data/speech. Variants that are deliberately unintelligible (whispering, robots,
# croaks) are left out, and so are those tiny.en mostly cannot follow even clean (most of the
# Caribbean accent's, Andy, david, shelby): the set measures what precision changes in text a
# model can read, and a transcript that is already noise flips on any change.
VOICES: tuple[str, ...] = (
    "en-us+m2",
    "en-us+f1",
    "en-us+m3",
    "en-us+f3",
    "en-us+f4",
    "en-us+Annie",
    "en-us+klatt",
    "en-us+m7",
    "en-gb+m2",
    "en-gb+f2",
    "en-gb+m4",
    "en-gb+f4",
    "en-gb+klatt3",
    "en-gb+linda",
    "en-gb-x-rp+m5",
    "en-gb-x-rp+f5",
    "en-gb-x-rp+edward",
    "en-gb-scotland+m6",
    "en-gb-scotland+m2",
    "en-gb-scotland+john",
    "en-gb-x-gbclan+m7",
    "en-gb-x-gbclan+f1",
    "en-gb-x-gbcwmd+m8",
    "en-gb-x-gbcwmd+steph",
    "en-us+m6",
    "en-029+f4",
    "en-gb+m1",
    "en-us-nyc+m4",
    "en-us-nyc+f2",
    "en-us-nyc+robert",
    "en-us+klatt4",
    "en-gb+Alicia",
    "en-us+benjamin",
    "en-gb+aunty",
    "en-us+max",
    "en-gb-x-rp+m1",
)

SENTENCES: tuple[str, ...] = (
    "The committee will meet again on Thursday to discuss the new parking rules.",
    "Could you send me the slides before the call starts?",
    "She left her umbrella on the train and had to walk home in the rain.",
    "The bakery on the corner sells out of bread by nine in the morning.",
    "We need three more volunteers for the weekend cleanup.",
    "His grandfather built the wooden boat by hand over two summers.",
    "Please turn off the lights when you leave the room.",
    "The museum is closed on Mondays for maintenance.",
    "I think the meeting went better than anyone expected.",
    "The price of coffee has gone up again this month.",
    "Our flight was delayed because of heavy fog at the airport.",
    "The children planted tomatoes and beans in the school garden.",
    "Remember to bring your passport and a printed copy of the ticket.",
    "The new bridge will connect the two halves of the city.",
    "He plays the piano every evening after dinner.",
    "The report shows that sales doubled in the last quarter.",
    "A strong wind knocked down several trees along the river.",
    "They moved to a small village near the coast last spring.",
    "The doctor said I should drink more water and sleep earlier.",
    "Can you tell me where the nearest pharmacy is?",
    "The library has extended its opening hours during exam season.",
    "My sister is learning to speak Japanese before her trip.",
    "The engineers found a crack in the main support beam.",
    "We watched the sunset from the top of the hill.",
    "The recipe calls for two cups of flour and a pinch of salt.",
    "The train to the airport leaves every fifteen minutes.",
    "Nobody noticed that the clock on the wall had stopped.",
    "The teacher asked the students to read the first chapter by Friday.",
    "Fresh snow covered the mountains overnight.",
    "The company plans to hire twenty new engineers next year.",
    "I left my keys in the kitchen drawer.",
    "The old lighthouse still guides ships into the harbour.",
    "She finished the marathon in just under four hours.",
    "The software update fixed most of the problems we reported.",
    "Let me know if you need any help with the move.",
    "The garden looks beautiful after all the rain.",
    "The orchestra rehearsed the symphony for six weeks.",
    "Traffic on the highway was slow because of an accident.",
    "He apologised for arriving late to the interview.",
    "The farmers hope for a dry autumn so they can harvest the wheat.",
    "Our neighbours have a dog that barks at every passing car.",
    "The hotel room had a view of the ocean.",
    "I will call you back as soon as I get home.",
    "The council voted to build a new swimming pool.",
    "The detective found a clue hidden under the carpet.",
    "Most birds fly south before the winter arrives.",
    "The shop will open an hour later on public holidays.",
    "She painted the fence bright blue last weekend.",
    "The battery in my phone dies by the middle of the afternoon.",
    "We should leave early to avoid the evening rush.",
    "The scientist explained her results in simple words.",
    "The cat slept on the warm windowsill all afternoon.",
    "His speech made the whole audience laugh.",
    "The river flooded the fields after a week of storms.",
    "Please write your name at the top of each page.",
    "The festival attracts thousands of visitors every summer.",
    "The kettle is broken, so we boiled water in a pan.",
    "The new manager wants weekly reports from every team.",
    "A small boat drifted slowly across the lake.",
    "The students built a robot that can sort recycling.",
    "I prefer tea in the morning and coffee after lunch.",
    "The road to the village is narrow and full of bends.",
    "They celebrated their anniversary at a quiet restaurant.",
    "The printer on the second floor is out of paper again.",
    "Heavy clouds gathered over the valley before the storm.",
    "The nurse checked his temperature every two hours.",
    "We are running out of milk and eggs.",
    "The old castle is open to visitors on weekends.",
    "Her first novel was translated into eleven languages.",
    "The bus driver waited for the last passenger to sit down.",
    "The team celebrated after winning the final match.",
    "Do not forget to water the plants while I am away.",
    "The city plans to plant a thousand trees this year.",
    "A loud noise woke everyone in the house at midnight.",
    "The professor will post the grades on Tuesday.",
    "The market sells fresh fish every morning.",
    "He fixed the bicycle with a spanner and some wire.",
    "The weather forecast promises sunshine for the rest of the week.",
    "Our team meets every Wednesday at ten.",
    "The parcel arrived two days earlier than expected.",
    "The lake freezes solid in the middle of January.",
    "She keeps a diary of every book she reads.",
    "The waiter brought us the wrong soup.",
    "Students must return their books before the holidays.",
    "The climbers reached the summit just before noon.",
    "The factory produces five hundred cars a day.",
    "I could hear music coming from the flat upstairs.",
    "The gardener trimmed the hedges along the path.",
    "The airline lost my suitcase on the way back.",
    "The mayor opened the new park with a short speech.",
    "Winter evenings are long and dark in the north.",
    "The pilot announced that we would land in twenty minutes.",
    "The shop assistant helped me find a warmer coat.",
    "The kids built a snowman in front of the school.",
    "The power went out during the thunderstorm.",
    "Please keep your voice down in the reading room.",
    "The chef added fresh herbs to the sauce.",
    "We spent the afternoon walking along the beach.",
    "The article explains how vaccines train the immune system.",
    "The store is offering a discount on winter boots.",
    "My grandmother tells the best stories about her childhood.",
    "The map shows a shortcut through the forest.",
    "The concert was cancelled because the singer was ill.",
    "The bank will close the branch on the high street.",
)


@dataclass(frozen=True)
class Utterance:
    """One sentence spoken one way, and the noise added to it when it is read."""

    id: str
    text: str
    voice: str
    speed_wpm: int
    pitch: int  # espeak-ng's -p, 0 to 99
    level_dbfs: float  # the clip's peak, before noise
    channel: str  # "clean", "telephone" (300-3400 Hz) or "room" (reverberation)
    noise: str | None  # "white" or "pink", added when read; None: none
    snr_db: float | None
    noise_seed: int | None
    split: str  # "tuning" or "held_out"

    def sox_effects(self) -> list[str]:
        channel = {
            "clean": [],
            "telephone": ["sinc", "300-3400"],
            "room": ["reverb", "40", "50", "60"],
        }[self.channel]
        # Brought down first, so that the channel's filter or reverberation does not clip.
        return ["gain", "-n", "-10", *channel, "gain", "-n", f"{self.level_dbfs:.1f}"]

    def manifest_entry(self, duration_s: float) -> dict:
        entry = {
            "id": self.id,
            "audio": f"{self.id}.flac",
            "text": self.text,
            "duration_s": round(duration_s, 2),
            "source": f"espeak-ng voice {self.voice} speed {self.speed_wpm} pitch {self.pitch} "
            f"(synthetic), {self.channel}, peak {self.level_dbfs:.0f} dBFS",
            "license": "generated",
            "voice": self.voice,
            "split": self.split,
        }
        if self.noise:
            entry["noise"] = {"color": self.noise, "snr_db": self.snr_db, "seed": self.noise_seed}
        return entry


def utterances(seed: int = 73) -> list[Utterance]:
    """Every sentence in VOICES_PER_SENTENCE voices, with seeded rates, pitches, levels, channels
    and noise. Voices rotate so that each speaks about as many sentences as any other."""
    rng = np.random.default_rng(seed)
    held_out = {voice for index, voice in enumerate(VOICES) if index % HELD_OUT_EVERY == HELD_OUT_EVERY - 1}
    made = []
    for index, text in enumerate(SENTENCES):
        for turn in range(VOICES_PER_SENTENCE):
            voice = VOICES[(index * VOICES_PER_SENTENCE + turn) % len(VOICES)]
            noise = rng.choice(["none", "none", "white", "pink"])
            made.append(
                Utterance(
                    id=f"bs_{index:03d}_{turn}",
                    text=text,
                    voice=voice,
                    speed_wpm=int(rng.integers(130, 201)),
                    pitch=int(rng.integers(30, 71)),
                    level_dbfs=float(rng.uniform(-38.0, -12.0)),
                    channel=str(rng.choice(["clean", "clean", "clean", "telephone", "room"])),
                    noise=None if noise == "none" else str(noise),
                    snr_db=None if noise == "none" else round(float(rng.uniform(10.0, 30.0)), 1),
                    noise_seed=None if noise == "none" else int(rng.integers(0, 2**31)),
                    split="held_out" if voice in held_out else "tuning",
                )
            )
    return made


def make_clip(utterance: Utterance, folder: Path) -> Path:
    """Speak the utterance with espeak-ng; store it trimmed of its silences, as 16 kHz mono FLAC."""
    path = folder / f"{utterance.id}.flac"
    with tempfile.NamedTemporaryFile(suffix=".wav") as wav:
        subprocess.run(
            [
                "espeak-ng",
                "-v",
                utterance.voice,
                "-s",
                str(utterance.speed_wpm),
                "-p",
                str(utterance.pitch),
                "-w",
                wav.name,
                utterance.text,
            ],
            check=True,
        )
        # -D: no dither, so the same clip comes out sample for sample on every run (dither's
        # one-bit noise is enough to flip a borderline transcript). The silences espeak-ng leaves
        # around a sentence go (a tenth of a second stays): they cost bytes and say nothing.
        trim = ["silence", "1", "0.05", "0.1%", "reverse", "silence", "1", "0.05", "0.1%", "reverse"]
        subprocess.run(
            ["sox", "-D", wav.name, "-r", "16000", "-c", "1", "-b", "16", "-C", "8", str(path)]
            + trim
            + ["pad", "0.1", "0.1"]
            + utterance.sox_effects(),
            check=True,
        )
    return path


def duration_s(path: Path) -> float:
    return float(subprocess.run(["soxi", "-D", str(path)], check=True, capture_output=True, text=True).stdout)


def write_set(folder: Path) -> list[Utterance]:
    folder.mkdir(parents=True, exist_ok=True)
    made = utterances()
    with (folder / "manifest.jsonl").open("w") as manifest:
        for utterance in made:
            path = make_clip(utterance, folder)
            manifest.write(json.dumps(utterance.manifest_entry(duration_s(path))) + "\n")
    return made


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--folder", type=Path, default=FOLDER)
    args = parser.parse_args()
    made = write_set(args.folder)
    size_mb = sum(path.stat().st_size for path in args.folder.glob("*.flac")) / 1e6
    print(f"{len(made)} utterances, {len({u.voice for u in made})} voices, {size_mb:.1f} MB in {args.folder}")


if __name__ == "__main__":
    main()
