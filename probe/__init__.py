"""longprobe: probes for long-context language models."""

from probe import detectors, errors, metrics
from probe.attention.capture import ActivationCache, trace
from probe.attention.modifiers import ablate_heads, attention_window, mask_keys
from probe.attention.patching import patch_heads, record_heads
from probe.attention.rope import rope_base
from probe.detectors import Detection, attribute, detect
from probe.errors import LongprobeError, UnsupportedModelError
from probe.generation import answer, given_answer
from probe.memory.checkpointing import checkpointed
from probe.memory.planner import plan
from probe.models import load_model, tiny_model, to_bridge
from probe.probes.attribution import (
    answer_attribution,
    attention_matrices,
    attention_rows,
    embedding_grad_norms,
    embedding_grads,
    information_flow,
)
from probe.probes.lsd import longppl, pool_longppl, token_lsd
from probe.probes.noise_restraint import noise_restraint
from probe.probes.position_bias import context_selector
from probe.probes.retrieval import RetrievalScores, retrieval_scores
from probe.target import target_loss
from probe.tasks import Sample

__all__ = [
    "ActivationCache",
    "RetrievalScores",
    "Detection",
    "Sample",
    "detect",
    "detectors",
    "errors",
    "metrics",
    "LongprobeError",
    "UnsupportedModelError",
    "ablate_heads",
    "answer",
    "answer_attribution",
    "given_answer",
    "attention_window",
    "attention_matrices",
    "attention_rows",
    "attribute",
    "checkpointed",
    "context_selector",
    "embedding_grad_norms",
    "embedding_grads",
    "information_flow",
    "load_model",
    "longppl",
    "mask_keys",
    "noise_restraint",
    "patch_heads",
    "plan",
    "pool_longppl",
    "record_heads",
    "retrieval_scores",
    "rope_base",
    "target_loss",
    "tiny_model",
    "to_bridge",
    "token_lsd",
    "trace",
]
