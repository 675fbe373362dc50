"""A stand-in peer for the exchange's test: scores each source by its length in characters, through
the runners' shared loop (:func:`peer_io.run`).

    python -m analyses.peers.fake_peer EXPORTED.jsonl SCORES.jsonl
"""

from . import peer_io


def main(argv: list[str] | None = None) -> None:
    peer_io.run(
        peer_io.arguments(argv=argv), lambda sample: [end - start for start, end in sample["sources"]]
    )


if __name__ == "__main__":
    main()
