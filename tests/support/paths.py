"""Where the repository and its shipped files are, wherever a test module sits below tests/."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIGS_DIR = REPO_ROOT / "configs"
SPEECH_DIR = REPO_ROOT / "tests" / "data" / "speech"
