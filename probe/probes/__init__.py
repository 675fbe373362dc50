"""The probes: what a model reads from its context, each measured exactly.

- :mod:`~probe.probes.attribution`: attention rows and matrices, information flow, embedding gradients;
- :mod:`~probe.probes.key_removal`: the key-removal gradient;
- :mod:`~probe.probes.lrp`: AttnLRP relevance;
- :mod:`~probe.probes.lsd` (with :mod:`~probe.probes.logprobs` and :mod:`~probe.probes.alignment`):
  long-short difference, key tokens and LongPPL;
- :mod:`~probe.probes.retrieval`: retrieval heads;
- :mod:`~probe.probes.at2`: AT2's learned head weights;
- :mod:`~probe.probes.position_bias`: position bias as a property of the attention graph;
- :mod:`~probe.probes.noise_restraint`: context-noise restraint (CDT).
"""
