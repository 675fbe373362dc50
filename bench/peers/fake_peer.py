"""A stand-in peer for the exchange's test: scores each source by its length in characters, through
the runners' shared loop (:func:`peer_io.run`).

python bench/peers/fake_peer.py EXPORTED.jsonl SCORES.jsonl
"""

import peer_io

args = peer_io.arguments()
peer_io.run(args, lambda sample: [end - start for start, end in sample["sources"]])
