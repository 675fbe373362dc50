"""Position bias from the attention graph (Wu et al., ICML 2025; Wang et al., "Transformers Are Biased
for Long-Context Modeling"): theory, controlled study, LMs.

- :mod:`analyses.position_bias.theory`: Cesàro, decay and RoPE selectors beside their closed forms;
- :mod:`analyses.position_bias.controlled`: attention-only networks trained with no bias in the
  data: accuracy gaps, attention maps, sinks, the context selector vs layers;
- :mod:`analyses.position_bias.real_models`: first-token mass and lost in the middle on real LMs;
- :mod:`analyses.position_bias.presets`: the settings of a run;
- :mod:`analyses.position_bias.cli`: ``python -m analyses.position_bias``, which writes the figures.
"""

from .cli import main, parse_args

__all__ = ["main", "parse_args"]
