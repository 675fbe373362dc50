"""longprobe: probes for long-context language models."""

from probe.attribution import attention_matrices, attention_rows, embedding_grad_norms, information_flow
from probe.models import load_model, tiny_model, to_bridge
from probe.trace import ActivationCache, UnsupportedModelError, target_loss, trace

__all__ = [
    "ActivationCache",
    "UnsupportedModelError",
    "attention_matrices",
    "attention_rows",
    "embedding_grad_norms",
    "information_flow",
    "load_model",
    "target_loss",
    "tiny_model",
    "to_bridge",
    "trace",
]
