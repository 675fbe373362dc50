"""Every notebook in notebooks/ runs top to bottom at tiny settings (its `parameters` cell overridden)."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
TINY_MODEL = "<tiny model folder>"  # replaced by the `tiny_model_folder` fixture's path
TINY_SETTINGS = {
    "at2.ipynb": {
        "MODEL": TINY_MODEL,
        "LENGTH": 256,
        "TRAIN_SAMPLES": 1,
        "MASKS": 8,
        "TASKS": ["multihop-4"],
        "STUDIES": None,  # no bundled head weights: learn them and run a small study
    },  # fmt: skip
    "claims.ipynb": {"KEYS": ["nope_first", "decay_last", "retrieval_heads", "cdt_scale"]},
    "context_cite.ipynb": {
        "MODEL": TINY_MODEL,
        "LENGTH": 256,
        "STUDY": None,
        "MASKS": 8,
        "TASKS": ["multihop-4"],
        "ALPHA": 1e-5,  # removals move the tiny model's log P by ~0.01 nats: a LASSO at 0.01 keeps no source
        "OURS": ["key_removal_banzhaf", "leave_one_out"],  # so its context_cite is constant, without an LDS
    },  # fmt: skip
    "cost_and_precision.ipynb": {
        "MODEL": TINY_MODEL,
        "LENGTHS": [256],
        "OTHER": None,
        "LENGTH": 192,
        "MASKS": 8,
        "DETECTORS": ["attention", "key_removal_banzhaf", "leave_one_out", "context_cite"],  # at2: no weights
    },  # fmt: skip
    "detector_compare.ipynb": {"MODEL": TINY_MODEL, "LENGTH": 256},
    "faithful_default.ipynb": {"MODEL": TINY_MODEL, "LENGTH": 192, "STUDY": None},
    "hotpotqa.ipynb": {"MODEL": TINY_MODEL, "SEED": 7309, "MASKS": 4},  # 1,098 tokens: within 2K
    "key_removal.ipynb": {
        "MODEL": TINY_MODEL,
        "LENGTH": 256,
        "MASKS": 8,
        "SATURATION_MODEL": TINY_MODEL,
        "SATURATION_LENGTH": 256,
        "STUDY": None,
        "GAP_TASK": "multihop-4",  # 17 sources: room for 256 ceiling masks (kv has 2 at 256)
    },  # fmt: skip
    "layers.ipynb": {"MODEL": TINY_MODEL, "LENGTH": 256, "SPLIT_TASKS": ["document-2", "kv"]},  # no key token
    "learn_head_weights.ipynb": {
        "MODEL": TINY_MODEL,
        "LENGTH": 192,
        "TRAIN_SAMPLES": 2,
        "HELDOUT_LENGTH": 160,
        "MASKS": 6,
    },  # fmt: skip
    "longppl.ipynb": {"MODEL": TINY_MODEL, "LENGTH": 256, "K": 32, "D": 32},
    "noise_restraint.ipynb": {"MODEL": TINY_MODEL, "LENGTH": 192},
    "objectives.ipynb": {"MODEL": TINY_MODEL, "LENGTH": 128, "TRAIN_SAMPLES": 2, "STEPS": 1},
    "position_bias.ipynb": {"MODEL": TINY_MODEL, "LENGTH": 64, "STEPS": 30},
    "retrieval_heads.ipynb": {
        "MODEL": TINY_MODEL,
        "LENGTHS": [160],
        "DEPTHS": [0.5],
        "ABLATION_SAMPLES": 1,
        "K": 2,
    },  # fmt: skip
    "task_accuracy.ipynb": {
        "MODEL": TINY_MODEL,
        "TASKS": ["passkey", "kv", "multihop-1", "document-1"],
        "LENGTHS": [256],
        "SAMPLES": 1,
    },  # fmt: skip
    "the_reference.ipynb": {
        "EXHAUSTIVE": None,
        "MODEL": TINY_MODEL,
        "LENGTH": 256,
        "MASKS": 8,
        "TOP_M": [4, 8],
        "SIZES": [32, 256],
        "COPIED_MODEL": TINY_MODEL,
        "COPIED_LENGTH": 256,
    },  # fmt: skip
    "your_own_text.ipynb": {"MODEL": TINY_MODEL, "DETECTOR": "attention", "ESSAY_TOKENS": 300, "MASKS": 4},
}


def execute_notebook(path: Path, **parameters) -> nbformat.NotebookNode:
    """Run ``path`` in a fresh kernel, with ``parameters`` assigned right after its `parameters` cell."""
    notebook = nbformat.read(path, as_version=4)
    tagged = [i for i, cell in enumerate(notebook.cells) if "parameters" in cell.metadata.get("tags", [])]
    if not tagged:
        raise ValueError(f"{path.name} has no cell tagged 'parameters'")
    overrides = "\n".join(f"{name} = {value!r}" for name, value in parameters.items())
    notebook.cells.insert(tagged[0] + 1, nbformat.v4.new_code_cell(overrides))
    resources = {"metadata": {"path": ROOT}}
    NotebookClient(notebook, timeout=900, kernel_name="python3", resources=resources).execute()
    return notebook


def test_every_notebook_has_tiny_settings():
    assert sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb")) == sorted(TINY_SETTINGS)


@pytest.mark.real
@pytest.mark.parametrize("name", sorted(TINY_SETTINGS))
def test_notebook_runs(name, tiny_model_folder):
    settings = {k: str(tiny_model_folder) if v == TINY_MODEL else v for k, v in TINY_SETTINGS[name].items()}
    executed = execute_notebook(ROOT / "notebooks" / name, **settings)
    errors = [out for cell in executed.cells for out in cell.get("outputs", []) if out.output_type == "error"]
    assert not errors
