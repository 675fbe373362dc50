"""Atomic writes: never half-written, and concurrent writers of one path never collide."""

import threading

from probe.atomic import atomic_write


def test_concurrent_writers_of_one_path_never_collide(tmp_path):
    path = tmp_path / "table.csv"
    errors = []

    def write(i: int) -> None:
        try:
            for _ in range(20):
                atomic_write(path, lambda tmp: tmp.write_text(f"writer {i}\n" * 1000))
        except Exception as error:  # noqa: BLE001 - collected and asserted below
            errors.append(error)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    lines = set(path.read_text().splitlines())
    assert len(lines) == 1 and lines.pop().startswith("writer ")  # one whole write, not a mix
    assert sorted(p.name for p in tmp_path.iterdir()) == ["table.csv"]  # no temporary file left
