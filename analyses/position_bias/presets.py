"""The settings of a run: :class:`Preset` and the named presets (``--smoke``, ``--quick``, ``--paper``)."""

from __future__ import annotations

from dataclasses import dataclass

REAL_MODELS = ("smollm2-135m", "gemma3-270m")


@dataclass(frozen=True)
class Preset:
    """Everything a run depends on."""

    steps: int
    seeds: tuple[int, ...]
    n_layers: tuple[int, ...]  # network sizes without residual connections
    residual_n_layers: tuple[int, ...]  # network sizes with residual connections
    test_size: int
    pool: int | None  # pre-drawn training batches, cycled (None: fresh sequences every step, as the paper)
    windows: tuple[int, ...] = (5, 9, 13)
    prefixes: tuple[int, ...] = (2, 4, 6)
    models: tuple[str, ...] = REAL_MODELS
    text_length: int = 512
    texts: int = 2
    kv_length: int = 512
    kv_depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    kv_samples: int = 3


PRESETS = {
    "smoke": Preset(
        steps=30,
        seeds=(0,),
        n_layers=(2,),
        residual_n_layers=(2,),
        test_size=200,
        pool=10,
        windows=(5,),
        prefixes=(2,),
        models=("smollm2-135m",),
        text_length=64,
        texts=1,
        kv_length=300,
        kv_depths=(0.0, 1.0),
        kv_samples=1,
    ),
    "quick": Preset(
        steps=1000, seeds=(0,), n_layers=(2, 6), residual_n_layers=(2, 6), test_size=2000, pool=500
    ),
    "paper": Preset(
        steps=100_000,
        seeds=(0, 1, 2, 3, 4),
        n_layers=(2, 4, 6),
        residual_n_layers=(2, 6, 10),
        test_size=10_000,
        pool=None,
        kv_samples=10,
    ),
}
