"""Train AT2's score estimator with AT2's own trainer (``at2.AT2Trainer``) on longprobe's training samples.

    .venv-peers/at2/bin/python -m analyses.peers.at2.train /tmp/peers/at2_train.jsonl \
        [--per-task N] [--train-only]

The samples come from ``analyses.peers.at2.export_training``. As AT2's own training script
(``scripts/train_context_at2.py``): every context token a source (``source_type="token"``), 32 random
masks a sample (AT2's attention-mask ablation, each token kept with probability 1/2), the
logit-probability of the answer as the target, the Pearson-correlation loss, Adam at 1e-3 with a cosine
schedule for 1000 steps. Changed (NOTES.md): the answers are the exported ones (written as the trainer's
"generations", so it generates nothing), the answer is one target (``split_target_by=None``: nltk's
sentence data is unreachable and every answer is a few words), and a batch holds every sample (AT2's 512
needs 512 samples). Its work files go to ``bench/results/peers/at2_train/MODEL-SAMPLES-MASKS``
(resumable; small — AT2 keeps a sample's 32 masks of features in float16 — and committed as the passes
finish, so a run of hours resumes on a new machine); the estimator to ``estimators/MODEL.pt``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch
from at2 import AT2Trainer
from datasets import Dataset

from .run import ESTIMATORS, ExportedTask, feature_extractor, here, load

WORK = here.parents[2] / "bench" / "results" / "peers" / "at2_train"  # the repository root's results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("exported", type=Path)
    parser.add_argument("--per-task", type=int, default=None, help="each task's first N samples only")
    parser.add_argument("--masks", type=int, default=32, help="AT2's default")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--train-only", action="store_true", help="skip the passes: train on the samples already computed"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    records = [json.loads(line) for line in args.exported.read_text().splitlines()]
    if args.per_task is not None:
        task = [record["key"].rsplit("-", 2)[0] for record in records]
        records = [r for n, r in enumerate(records) if task[:n].count(task[n]) < args.per_task]
    folder = records[0]["model"]
    name = Path(folder).name
    save = WORK / f"{name}-{len(records)}-{args.masks}"
    generations = save / "generations"
    generations.mkdir(parents=True, exist_ok=True)
    answers = {i: r["text"][len(r["prompt"]) :] for i, r in enumerate(records)}
    (generations / "0_of_1.json").write_text(json.dumps(answers))
    model, tokenizer = load(folder)
    trainer = AT2Trainer(
        save_path=save,
        dataset=Dataset.from_list(records),
        model=model,
        tokenizer=tokenizer,
        task_from_example=lambda example, m, t: ExportedTask(example, m, t, source_type="token"),
        feature_extractor=feature_extractor(model),
        split_target_by=None,
        num_masks=args.masks,
    )
    start = time.perf_counter()
    trainer.generate(batch_size=1)  # the generations exist: this only records each task's size
    if not args.train_only:
        trainer.compute_features_and_outputs(batch_size=2)  # batch 2 as AT2's training script
    computed = time.perf_counter()
    done = [i for i in range(len(records)) if trainer.is_features_and_outputs_completed(i)]
    print("training on", [records[i]["key"] for i in done])
    estimator = trainer.train(batch_size=len(done), train_indices=done, device="cpu", save_name="default")
    trained = time.perf_counter()
    ESTIMATORS.mkdir(exist_ok=True)
    shutil.copy(save / "estimators" / "default" / "score_estimator.pt", ESTIMATORS / f"{name}.pt")
    print(
        f"{len(done)} samples; features and outputs {computed - start:.0f} s,"
        f" training {trained - computed:.0f} s;"
        f" weights L1 {estimator.linear.weight.abs().sum():.3f} -> {ESTIMATORS / f'{name}.pt'}"
    )


if __name__ == "__main__":
    main()
