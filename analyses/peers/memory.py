"""Which peers fit in memory at a length: each peer's runner on one held-out sample, in a fresh process
capped in address space and in wall-clock time; its peak resident memory and CPU seconds.

    python -m analyses.peers.memory --model smollm2-135m --length 4096 [--task multihop-4] [--seed 5000]
        [--cap-gib 16] [--wall 180] [--peers lxt gim:full ...]

The peak is the runner process's ``ru_maxrss`` (model loading included). A runner stopped at ``--wall``
reports what it reached by then, a lower bound. A runner that asks for more than ``--cap-gib`` of address
space (``RLIMIT_AS``) fails inside with its own error, which becomes the row's outcome, instead of
waking the kernel's OOM killer, which could take another job. One thread a runner, as in
:mod:`compare`. Writes ``bench/results/peers/memory-MODEL-LENGTH.csv``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import tempfile
import time
from pathlib import Path

import pandas as pd

from probe import load_model
from probe.atomic import atomic_write
from probe.models import converted_folder

from . import compare, exchange
from .export_samples import heldout_samples


def measure(command: list[str], cap_bytes: int, wall: float, log: Path) -> dict:
    """Run ``command`` from the repository root, as a runner runs (its output to ``log``), with its address
    space capped at ``cap_bytes``, killed after ``wall`` seconds; its peak resident MiB, CPU and wall
    seconds, and whether it was stopped."""

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (cap_bytes, cap_bytes))

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with log.open("w") as output:
        process = subprocess.Popen(
            command, cwd=compare.ROOT, env=env, preexec_fn=cap, stdout=output, stderr=output
        )
    start, stopped = time.monotonic(), False
    while True:
        pid, status, usage = os.wait4(process.pid, os.WNOHANG)
        if pid:
            break
        if not stopped and time.monotonic() - start > wall:
            process.kill()
            stopped = True
        time.sleep(0.2)
    process.returncode = os.waitstatus_to_exitcode(status)
    return {"peak_mib": usage.ru_maxrss / 1024, "cpu_seconds": usage.ru_utime + usage.ru_stime,
            "wall_seconds": time.monotonic() - start, "stopped": stopped,
            "exit_code": process.returncode, "log": log.read_text()[-300:]}  # fmt: skip


def outcome(measured: dict, answers: Path, wall: float) -> str:
    """What the runner did: scored, its recorded error, stopped at the wall, or how it exited."""
    lines = answers.read_text().splitlines() if answers.exists() else []
    answer = json.loads(lines[0]) if lines else {}
    if "scores" in answer:
        return "scored"
    if "error" in answer:
        return "error: " + answer["error"].strip().splitlines()[-1][:200]
    if measured["stopped"]:
        return f"stopped at {wall:.0f} s"
    return f"exit code {measured['exit_code']}: {measured['log'].strip().splitlines()[-1:]}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--task", default="multihop-4")
    parser.add_argument("--seed", type=int, default=5000)
    parser.add_argument("--peers", nargs="*", default=compare.PEERS)
    parser.add_argument("--cap-gib", type=float, default=16.0, help="address space a runner may take")
    parser.add_argument("--wall", type=float, default=180.0, help="seconds before a runner is stopped")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    out = args.out or compare.ROOT / "bench" / "results" / "peers" / f"memory-{args.model}-{args.length}.csv"
    model, tokenizer = load_model(args.model)
    [sample] = heldout_samples(model, tokenizer, [args.task], 1, args.seed, args.length)
    del model
    rows = []
    with tempfile.TemporaryDirectory() as work:
        exported = exchange.export([sample], converted_folder(args.model), Path(work) / "sample.jsonl")
        for spec in args.peers:
            answers = Path(work) / f"{spec.replace(':', '_')}.jsonl"
            command = compare.runner_command(spec, exported, answers, threads=1)
            measured = measure(command, int(args.cap_gib * 2**30), args.wall, answers.with_suffix(".log"))
            row = {"model": args.model, "length": args.length, "sample": exchange.sample_key(sample),
                   "tokens": len(sample.input_ids), "method": compare.label(spec),
                   "outcome": outcome(measured, answers, args.wall), "cap_gib": args.cap_gib,
                   **{k: measured[k] for k in ("peak_mib", "cpu_seconds", "wall_seconds")}}  # fmt: skip
            print(json.dumps(row), flush=True)
            rows.append(row)
    table = pd.DataFrame(rows)
    atomic_write(out, lambda tmp: table.to_csv(tmp, index=False))
    print(table.round(1).to_string(index=False))


if __name__ == "__main__":
    main()
