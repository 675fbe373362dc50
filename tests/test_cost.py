"""probe.cost: one plain forward pass, timed best of two, the unit of a detector's cost."""

from probe.checks import hf_model
from probe.cost import forward_seconds


def test_forward_seconds_is_the_faster_of_two_plain_passes(story):
    """Against a clock that ticks 5 s over the first pass and 2 s over the second, and the passes seen
    by the model: two, over the whole sample, without a cache, projecting ``logits_to_keep`` rows."""
    model, sample = story
    ticks = iter([0.0, 5.0, 10.0, 12.0])
    seen = []
    hook = hf_model(model).register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs), with_kwargs=True
    )
    try:
        assert forward_seconds(model, sample, clock=lambda: next(ticks), logits_to_keep=0) == 2.0
    finally:
        hook.remove()
    assert len(seen) == 2
    for call in seen:
        assert call["input_ids"].tolist() == [sample.input_ids.tolist()]
        assert call["use_cache"] is False and call["logits_to_keep"] == 0
