"""`neutrain generate`'s placement under a budget: the decoder layers that fit stay on the GPU, the rest stream.

The decision (:func:`neutrain.memory.residency.decide`) for the 8B at the budgets of real cards, its properties over
shapes and budgets (more budget never keeps fewer layers; a budget that holds everything streams nothing; too
small is refused in one line), and its predicted peak against the planner's training-side terms."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from neutrain.memory import Residency, decide
from neutrain.config import load_recipe
from neutrain.errors import UserInputError
from neutrain.memory import FIT_HEADROOM
from neutrain.memory import plan_recipe
from neutrain.memory import GIB, ModelShape, estimate, offload_traffic

LLAMA3_8B = ModelShape(4096, 14336, 32, 32, 8, 128256, False, 128)
FORMS = ("dense", "neuzip", "neuzip+offload")


def _decide(shape: ModelShape, gib: float | None, **kwargs) -> Residency:
    kwargs = {"prompt_tokens": 16, "new_tokens": 112, **kwargs}
    return decide(shape, None if gib is None else int(gib * GIB), **kwargs)


@pytest.mark.parametrize(("gib", "form", "resident"), [
    (22, "dense", 32), (16.5, "dense", 32), (14.5, "neuzip", 32), (12.7, "neuzip", 32),
    (11.5, "neuzip+offload", 26), (11, "neuzip+offload", 25), (9, "neuzip+offload", 18), (7, "neuzip+offload", 9),
    (5, "neuzip+offload", 2)])
def test_an_8b_keeps_on_the_card_the_layers_its_budget_holds(gib, form, resident):
    # Measured on an H200 before: 9 GiB streamed all 32 layers (3.97 GiB allocated, the same as under 5 GiB).
    r = _decide(LLAMA3_8B, gib)
    assert (r.form, r.resident, len(r.streamed)) == (form, resident, 32 - resident)
    assert r.predicted.reserved <= gib * GIB * (1 - FIT_HEADROOM)


def test_the_line_says_what_stays_what_streams_and_the_predicted_peak():
    r = _decide(LLAMA3_8B, 9)
    assert r.line == ("NeuZip lossless weights (bit-exact), keeping 18 of 32 decoder layers on the GPU, streaming 14 "
                      "from host memory (3.87 GiB over PCIe a token); predicted peak 8.49 GiB reserved, budget 9.00 GiB")
    assert r.summary()["streamed_layers"] == 14 and r.summary()["predicted_reserved_gib"] == pytest.approx(8.49, abs=0.005)
    assert "all 32 decoder layers resident" in _decide(LLAMA3_8B, 14.5).line


def test_a_budget_that_holds_everything_streams_nothing():
    for gib in (None, 80, 1e6):
        r = _decide(LLAMA3_8B, gib)
        assert (r.form, r.streamed, r.resident) == ("dense", (), 32)
    # A compressed run's checkpoint is placed compressed: all of it on the card.
    assert _decide(LLAMA3_8B, 80, dense=False, encoded=True).form == "neuzip"


def test_a_budget_too_small_for_every_layer_streamed_is_refused_in_one_line():
    with pytest.raises(UserInputError) as err:
        _decide(LLAMA3_8B, 3)
    line = str(err.value)
    assert "\n" not in line and line.startswith("--device-budget-gib: 3.00 GiB is too small to generate with this model")
    needed = float(line.split("needs a budget of ")[1].split(" GiB")[0])
    assert 4 < needed < 4.5  # every layer streamed: the embedding, lm_head, four slots and the decode buffers
    assert _decide(LLAMA3_8B, needed + 0.01).form == "neuzip+offload"


def test_the_headroom_is_the_training_fits():
    fits = _decide(LLAMA3_8B, 9).predicted.reserved
    assert _decide(LLAMA3_8B, fits / (1 - FIT_HEADROOM) / GIB + 1e-6).resident == 18
    assert _decide(LLAMA3_8B, fits / (1 - FIT_HEADROOM) / GIB - 1e-6).resident == 17


def test_the_kv_cache_of_a_long_generation_streams_more():
    short, long = _decide(LLAMA3_8B, 9), _decide(LLAMA3_8B, 9, prompt_tokens=4000, new_tokens=4000)
    assert long.resident < short.resident and long.positions == 8000


def test_the_decisions_peak_is_the_planners_training_side_terms():
    """Where generation and training hold the same buffers (the resident weights, the weight store's slots, the
    decode buffers, the KV cache of a sample), the decision's prediction is the run's planner's."""
    r = _decide(LLAMA3_8B, 9)
    k = len(r.streamed)
    train = estimate(LLAMA3_8B, batch=1, seq=1024, weights="neuzip-lossless", optimizer="lomo",
                     offload_weights=True, offload_layers=k)
    gen = r.predicted.terms
    assert r.phase == "generate" and r.streamed == train.settings["offloaded"]  # the layers training would offload
    assert gen["model"] == train.terms["weights"] + train.terms["weight_slots"]
    assert gen["decode_buffers"] == train.terms["decode_buffers"] + train.settings["vocab_slot_bytes"]
    assert r.layer_bytes == offload_traffic(LLAMA3_8B, slots=2, offloaded=k)["layer_bytes"]
    # The run's own phase plan for the recipe offloading the same layers, with a 16-token sample of 112 tokens.
    recipe = load_recipe("recipes/llama3_8b.yaml", [
        "memory.weights=neuzip-lossless", "memory.offload_weights=true", f"memory.offload_layers={k}",
        "eval.sample_prompt=fourteen bytes", "eval.sample_tokens=112"])
    sample = plan_recipe(recipe)["generate"].terms
    for term in ("model", "decode_buffers", "kv_cache", "activations", "logits"):
        assert gen[term] == sample[term], term
    # Every layer resident: the build's peak is the run's build (the vocabulary matrix encoded beside the model).
    whole = _decide(LLAMA3_8B, 14.5)
    build = plan_recipe(load_recipe("recipes/llama3_8b.yaml", ["memory.weights=neuzip-lossless"]))["build"]
    assert whole.phase == "build" and whole.predicted.terms == build.terms


@st.composite
def shapes(draw) -> ModelShape:
    heads = draw(st.sampled_from([2, 4, 8, 32, 64]))
    head_dim = draw(st.sampled_from([16, 64, 128]))
    hidden = heads * head_dim
    return ModelShape(hidden=hidden, intermediate=hidden * draw(st.integers(2, 4)) + draw(st.integers(0, 64)),
                      layers=draw(st.integers(1, 80)), heads=heads, kv_heads=heads // draw(st.sampled_from([1, 2, heads])),
                      vocab=draw(st.integers(256, 160_000)), tied=draw(st.booleans()), head_dim=head_dim)


def _outcome(shape, gib, prompt, new):
    try:
        return _decide(shape, gib, prompt_tokens=prompt, new_tokens=new)
    except UserInputError:
        return None


@settings(max_examples=60, deadline=None)
@given(shape=shapes(), budgets=st.lists(st.floats(0.01, 200), min_size=2, max_size=2),
       prompt=st.integers(1, 4096), new=st.integers(1, 4096))
def test_more_budget_never_keeps_fewer_layers_and_every_decision_fits(shape, budgets, prompt, new):
    low, high = sorted(budgets)
    small, large = _outcome(shape, low, prompt, new), _outcome(shape, high, prompt, new)
    if small is not None:
        assert large is not None, "a larger budget refused what a smaller one placed"
        assert large.resident >= small.resident
        assert FORMS.index(large.form) <= FORMS.index(small.form)  # never a slower form for more memory
    for r, gib in ((small, low), (large, high)):
        if r is None:
            continue
        assert r.predicted.reserved <= gib * GIB * (1 - FIT_HEADROOM)
        assert list(r.streamed) == sorted(set(r.streamed)) and all(0 <= i < shape.layers for i in r.streamed)
        assert r.resident + len(r.streamed) == shape.layers and (r.form == "neuzip+offload") == bool(r.streamed)
        assert r.positions == prompt + new
    unbounded = _decide(shape, None, prompt_tokens=prompt, new_tokens=new)
    assert unbounded.form == "dense" and not unbounded.streamed
