"""A stand-in peer for the exchange's test: scores each source by its length in characters.

python bench/peers/fake_peer.py EXPORTED.jsonl SCORES.jsonl
"""

import json
import sys
from pathlib import Path

exported, out = map(Path, sys.argv[1:3])
lines = []
for line in exported.read_text().splitlines():
    sample = json.loads(line)
    scores = [end - start for start, end in sample["sources"]]
    lines.append(json.dumps({"key": sample["key"], "scores": scores, "seconds": 0.0}))
out.write_text("\n".join(lines) + "\n")
