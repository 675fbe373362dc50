"""The README quotes files, not memories: its recorded runs equal the records ``bench.timed`` wrote."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench import timed

ROOT = Path(__file__).resolve().parents[1]


def test_the_readme_quotes_the_recorded_runs_and_stays_a_guide():
    readme = (ROOT / "README.md").read_text()
    block = timed.readme_block()
    assert block in readme  # python -m bench.timed --readme rewrites it
    for path in [path for path in timed.RECORDS.values() if path.exists()]:
        assert str(path.relative_to(ROOT)) in block
        assert json.loads(path.read_text())["exit_code"] == 0, f"{path} records a failed run"
    assert len(readme.splitlines()) <= 250


def test_the_readme_block_is_rewritten_from_the_records(tmp_path, monkeypatch):
    record = {"command": "x", "started_utc": "2026-11-25T20:00:00+00:00", "seconds": 754.4, "exit_code": 0,
              "machine": {"cpu": "AMD EPYC", "cores": 2, "flags": [], "memory_gib": 23.5,
                          "load_at_start": [0.31, 0.5, 0.6]}}  # fmt: skip
    records = {}
    for name in timed.RECORDS:
        records[name] = tmp_path / f"{name.replace(' ', '_')}.json"
        records[name].write_text(json.dumps(record))
    monkeypatch.setattr(timed, "RECORDS", records)
    monkeypatch.setattr(timed, "ROOT", tmp_path)
    block = timed.readme_block()
    assert "`make test`: 12 min 34 s on 2 cores of AMD EPYC" in block and "load 0.31 at the start" in block
    assert "GiB resident" not in block  # a record made before the peak was measured says nothing of it
    records["make test"].write_text(json.dumps(record | {"peak_rss_gib": 6.5}))
    assert (
        "load 0.31 at the start, peak 6.5 GiB resident (its largest process), 2026-11-25"
        in timed.readme_block()
    )


def test_a_record_keeps_the_commands_peak_memory(tmp_path):
    """A command touching 600 MiB is recorded at 0.6 GiB (bench.timed runs fresh: no other child counts)."""
    path, touch = tmp_path / "run.json", "block = bytearray(600 * 2**20); block[::4096] = b'x' * (600 * 256)"
    command = [sys.executable, "-m", "bench.timed", path, "--", sys.executable, "-c", touch]
    subprocess.run(command, cwd=ROOT, check=True)
    assert json.loads(path.read_text())["peak_rss_gib"] == pytest.approx(0.6, abs=0.1)


def test_the_quick_start_output_is_the_committed_run():
    """The quick start's answer and top three sentences are those of ``figures/quick_start/`` (the
    ``analyses.attribute`` run the README names), to the digits shown."""
    import pandas as pd

    readme = (ROOT / "README.md").read_text()
    run = ROOT / "figures" / "quick_start"
    settings = json.loads((run / "settings.json").read_text())
    shown = readme.split("<!-- quick-start:start -->\n")[1].split("\n<!-- quick-start:end -->")[0]
    top = pd.read_csv(run / "sources.csv").sort_values("rank").head(3)
    assert shown.splitlines() == [f"{int(r.rank)}. {r.score:.3f} — {r.text}" for r in top.itertuples()]
    assert f'answers "{settings["response"]}"' in " ".join(readme.split())
    assert settings["model"] == "smollm2-135m" and settings["detector"] == "key_removal_banzhaf"
    assert f'--query "{settings["query"]}"' in " ".join(readme.split())


INTERVAL = re.compile(r"[−-]?\d+\.\d+ \[[−-]?\d+\.\d+, [−-]?\d+\.\d+\]")
NARRATION = re.compile(
    r"\b(this|next|previous|last|earlier|\w+th|first|second|third) session\b", re.IGNORECASE
)


def test_every_interval_the_readme_quotes_is_one_results_states():
    """One source for every number: an estimate with its interval in README.md is copied from RESULTS.md
    (which quotes the study files), so the guide cannot say what the report does not."""
    readme, results = (ROOT / "README.md").read_text(), (ROOT / "RESULTS.md").read_text()
    quoted = INTERVAL.findall(readme)
    assert quoted and [value for value in quoted if value not in results] == []


def test_the_reports_do_not_narrate_how_the_project_was_made():
    """Dates and commits where history matters, never "the third session" (README, RESULTS, the
    benchmarks' and studies' READMEs and protocols)."""
    folders = [ROOT / "bench", ROOT / "analyses", ROOT / "figures" / "studies"]
    documents = [ROOT / "README.md", ROOT / "RESULTS.md", *(p for f in folders for p in f.glob("**/*.md"))]
    found = [f"{path.relative_to(ROOT)}: {match}" for path in documents
             for match in NARRATION.findall(path.read_text())]  # fmt: skip
    assert found == []
