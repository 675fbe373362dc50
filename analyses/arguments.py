"""Command-line arguments every analysis shares: where its model runs (``--device``, ``--dtype``) and
the output folder, each checked before any model loads, and :func:`load`, which loads a model with them.

Under ``accelerate launch`` / ``torchrun`` the default device is each process's own GPU
(:func:`analyses.sweep.process_device`), so the processes of a sweep do not share one GPU.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

import probe

from .sweep import process_device

DTYPES = ("float32", "bfloat16", "float16")


def length_setting(text: str) -> int | None:
    """``--length``: a number of tokens, or ``natural`` (None: a real question's own length)."""
    if text == "natural":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of tokens or 'natural', got {text!r}") from None


def add_device_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--device`` and ``--dtype`` to ``parser``."""
    parser.add_argument(
        "--device",
        default=None,
        help="where to run the model (cpu, cuda, cuda:1, ...; default: this process's own device: under "
        "accelerate launch / torchrun with GPUs each process its own GPU, cuda:LOCAL_RANK; else the GPU "
        "when there is one, else the CPU)",
    )
    parser.add_argument(
        "--dtype", default=None, choices=DTYPES, help="the model's parameter dtype (default: the model's own)"
    )


def check_device_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse (``parser.error``) a ``--device`` this machine does not have, before any model loads."""
    if args.device is None:
        return
    if torch.cuda.is_available():
        process_device()  # first: under a launcher this makes "cuda" this process's GPU, not cuda:0
    try:
        torch.empty(0, device=args.device)
    except (RuntimeError, AssertionError) as error:
        parser.error(f"--device {args.device} is not available here: {error}")


def check_out(parser: argparse.ArgumentParser, path: Path) -> None:
    """Make the output folder ``path`` (``--out``, with its parents); refuse (``parser.error``) one
    that is not a folder, cannot be created or is not writable."""
    if path.exists() and not path.is_dir():
        parser.error(f"--out {path} exists and is not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        parser.error(f"--out {path} cannot be created: {error}")
    if not os.access(path, os.W_OK):
        parser.error(f"--out {path} is not writable")


def load(args: argparse.Namespace, name: str | None = None) -> tuple:
    """``probe.load_model`` of ``name`` (default ``args.model``) with ``args.dtype``, on ``args.device``
    or else this process's own device."""
    # with GPUs, the process group first (as in check_device_arguments); without, nothing to choose:
    # the CPU, and the processes join their group only when the sweep starts, as always
    own = process_device() if torch.cuda.is_available() else None
    dtype = getattr(torch, args.dtype) if args.dtype else None
    return probe.load_model(name or args.model, dtype=dtype, device=args.device or own)


def resume_settings(args: argparse.Namespace, *ignored: str) -> dict:
    """The settings a run's parts are made with, for ``sweep(settings=...)``: every argument but where
    the outputs go, whether to resume, and where the model runs (none of them changes a row), nor
    ``ignored``. A ``--resume`` with other settings is then refused, naming the difference."""
    return {
        key: value for key, value in vars(args).items() if key not in {"out", "resume", "device", *ignored}
    }
