"""Recording benchmark results: a markdown table appended to RESULTS.md with machine, date and
command, and optionally a JSON file under benchmarks/results/."""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from pathlib import Path

import torch

RESULTS_MD = Path(__file__).parent / "RESULTS.md"


def machine_description() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    parts = [f"{os.cpu_count()} cores ({cpu})", f"torch {torch.__version__}"]
    if torch.cuda.is_available():
        parts.insert(0, torch.cuda.get_device_name(0))
    return ", ".join(parts)


def markdown_table(headers: list[str], rows: list[list]) -> str:
    def cell(value) -> str:
        if not isinstance(value, float):
            return str(value)
        # Three significant figures, but a large figure whole (18600, not 1.86e+04).
        return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.3g}"

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def titled_tables(tables: list[tuple[str, str]]) -> str:
    """(title, markdown table) pairs as one RESULTS.md body, a ### heading over each table."""
    return "\n\n".join(f"### {title}\n\n{table}" for title, table in tables)


def record(
    title: str, table: str, notes: str = "", json_path: Path | None = None, metrics: dict | None = None
) -> None:
    date = datetime.date.today().isoformat()
    command = " ".join([Path(sys.executable).name, *sys.argv])
    machine = machine_description()
    block = f"\n## {title}\n\n- machine: {machine}\n- date: {date}\n- command: `{command}`\n\n{table}\n"
    if notes:
        block += f"\n{notes}\n"
    with RESULTS_MD.open("a") as out:
        out.write(block)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(
            json.dumps(
                {"machine": machine, "date": date, "command": command, "metrics": metrics or {}}, indent=2
            )
            + "\n"
        )
    print(block)
