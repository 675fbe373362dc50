"""Run a command and record what it cost, where and under which load: the file behind a number the
README quotes (``make figures RECORD=1``, ``make test RECORD=1``).

    python -m bench.timed bench/results/make_test.json -- .venv/bin/python -m pytest -q
    python -m bench.timed --readme     # rewrite README's block of recorded runs from the files

The record (JSON): the command, its exit code, wall seconds, the peak resident memory of its largest
process (``peak_rss_gib``: ``getrusage``'s children's maximum), the UTC start, and the machine at the
start — CPU model, cores, the flags that decide bf16 speed (``avx512_bf16``, ``amx_bf16``), memory,
load averages. README.md quotes the records between ``<!-- runs:start -->`` and ``<!-- runs:end -->``;
``tests/test_readme.py`` checks that block equals :func:`readme_block` of the committed files.
"""

from __future__ import annotations

import datetime
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORDS = {
    "make figures": ROOT / "bench/results/make_figures.json",
    "make test": ROOT / "bench/results/make_test.json",
}
FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
START, END = "<!-- runs:start -->", "<!-- runs:end -->"


def machine() -> dict:
    """The CPU, its cores, the flags that matter, memory and the load averages now."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
    flags = set(fields.get("flags\t\t", "").split())
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "cpu": fields.get("model name\t", "").strip() or "unknown",
        "cores": os.cpu_count(),
        "flags": sorted(flags & set(FLAGS)),
        "memory_gib": round(memory / 2**30, 1),
        "load_at_start": [round(x, 2) for x in os.getloadavg()],
    }


def peak_rss_gib() -> float:
    """The peak resident memory of the largest process this one has waited for, in GiB."""
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return round(peak / (2**30 if sys.platform == "darwin" else 2**20), 1)  # bytes on macOS, KiB on Linux


def record(path: Path, command: list[str]) -> int:
    """Run ``command``, write its record to ``path`` (atomically), return its exit code."""
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    found = {"command": " ".join(command), "started_utc": now, "machine": machine()}
    start = time.perf_counter()
    code = subprocess.call(command)
    found |= {
        "seconds": round(time.perf_counter() - start, 1),
        "exit_code": code,
        "peak_rss_gib": peak_rss_gib(),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(found, indent=1) + "\n")
    tmp.replace(path)
    return code


def readme_block() -> str:
    """README's lines for the recorded runs, from the committed records (a run not recorded yet has none)."""
    lines = [START]
    for name, path in RECORDS.items():
        if not path.exists():
            continue
        run = json.loads(path.read_text())
        minutes, seconds = divmod(round(run["seconds"]), 60)
        box = run["machine"]
        flags = ", ".join(box["flags"]) or "none of " + ", ".join(FLAGS)
        peak = (
            f"peak {run['peak_rss_gib']} GiB resident (its largest process), "
            if "peak_rss_gib" in run
            else ""
        )
        lines.append(
            f"- `{name}`: {minutes} min {seconds} s on {box['cores']} cores of {box['cpu']} "
            f"(flags: {flags}), "
            f"load {box['load_at_start'][0]} at the start, {peak}{run['started_utc'][:10]} "
            f"([record]({path.relative_to(ROOT)}))"
        )
    return "\n".join([*lines, END])


def main() -> None:
    if sys.argv[1:] == ["--readme"]:
        readme = ROOT / "README.md"
        text = readme.read_text()
        head, rest = text.split(START, 1)
        readme.write_text(head + readme_block() + rest.split(END, 1)[1])
        return
    if len(sys.argv) < 4 or sys.argv[2] != "--":
        raise SystemExit(__doc__)
    sys.exit(record(Path(sys.argv[1]), sys.argv[3:]))


if __name__ == "__main__":
    main()
