"""The console script prints each file's transcript, or one JSON object per file, and reports
bad input on stderr with a non-zero exit status."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from engine.model.audio import load_audio_file
from engine.transcribe.cli import main
from tests.support.encoding import MANY_CHANNEL_UPLOADS, in_every_channel
from tests.support.paths import REPO_ROOT
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


@pytest.mark.slow
def test_files_of_many_channels_are_transcribed_by_the_console_script_without_a_crash(tmp_path):
    """In a process of its own: a fault in native decoding code would end it with a signal."""
    jfk = load_audio_file(SPEECH_DIR / "jfk.flac")
    files = []
    for case in MANY_CHANNEL_UPLOADS:
        path = tmp_path / f"{case.name}.{case.upload.extension}"
        path.write_bytes(in_every_channel(jfk, case))
        files.append(str(path))
    finished = subprocess.run(
        [sys.executable, "-m", "engine.transcribe.cli", "transcribe", *files, "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    assert finished.returncode == 0, finished.stderr[-2000:]
    objects = [json.loads(line) for line in finished.stdout.strip().splitlines()]
    assert [o["file"] for o in objects] == files
    for transcript in objects:
        assert "ask not what your country can do for you" in transcript["text"].lower(), transcript
