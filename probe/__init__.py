"""longprobe: probes for long-context language models."""

from probe.models import load_model, tiny_model

__all__ = ["load_model", "tiny_model"]
