"""The console script prints each file's transcript, or one JSON object per file, and reports
bad input on stderr with a non-zero exit status."""

from __future__ import annotations

import json

from engine.transcribe.cli import main
from tests.support.speech import SPEECH_DIR


def test_transcribe_json_prints_one_object_per_file_in_order(capsys):
    files = [str(SPEECH_DIR / "jfk.flac"), str(SPEECH_DIR / "osr72_01.flac")]
    assert main(["transcribe", *files, "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    objects = [json.loads(line) for line in lines]
    assert [o["file"] for o in objects] == files
    assert "ask not what your country can do for you" in objects[0]["text"]
    assert objects[1]["text"].lower().startswith("a gold ring")


def test_transcribe_reports_a_file_that_is_not_audio_and_exits_non_zero(tmp_path, capsys):
    not_audio = tmp_path / "notes.wav"
    not_audio.write_text("these are meeting notes, not audio")
    assert main(["transcribe", str(not_audio)]) == 2
    assert "notes.wav" in capsys.readouterr().err
