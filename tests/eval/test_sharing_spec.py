"""The shared-selection option as a spec (fathom_jax.methods.sharing): parsing, rules resolved per model, errors."""

import pytest

from fathom_jax import methods
from fathom_jax.methods.sharing import SharedSelection, parse_option, parse_spec


class Gemma3Like:
    """Gemma 3 270M's layer pattern: 18 layers, global ones at 5, 11, 17."""

    n_layers = 18
    global_layers = (5, 11, 17)


def test_parse_round_trip():
    method, sharing = parse_spec("fathom:48@share=0,2,mid@budget=256")
    assert method == methods.Fathom(48)
    assert sharing == SharedSelection((0, 2, "mid"), 256)
    assert sharing.ranking == "mass" and hash(sharing) == hash(SharedSelection((0, 2, "mid"), 256))
    assert parse_spec(method.spec + sharing.spec) == (method, sharing)
    ranked = parse_spec("sparq:8@share=every4@budget=512@rank=weight")[1]
    assert ranked == SharedSelection(("every4",), 512, "weight") and ranked.spec.endswith("@rank=weight")
    assert parse_spec("fathom:48") == (methods.Fathom(48), None)
    topk = parse_spec("fathom:48@share=0,mid@budget=1024@rank=rank@attend=topk")[1]
    assert topk == SharedSelection((0, "mid"), 1024, "rank", "topk")
    assert parse_option(topk.spec.removeprefix("@")) == topk and topk.spec.endswith("@rank=rank@attend=topk")
    assert topk.label == "shared 0,mid / 1024 (rank, top-k)"
    assert SharedSelection((0,), 256, attending="all").spec == "@share=0@budget=256"  # the default is not spelled


@pytest.mark.parametrize("rule, layers", [
    ("first,mid", (0, 15)), ("0,2,mid", (0, 2, 15)), ("every4", (0, 4, 8, 12, 16, 20, 24, 28)),
    ("all", tuple(range(30))), ("0,every8,29", (0, 8, 16, 24, 29)),
])
def test_rules_on_a_llama_stack(rule, layers):
    assert parse_option(f"share={rule}@budget=256").resolve(30) == layers


@pytest.mark.parametrize("rule, layers", [("first", (5,)), ("first,mid", (5, 11)), ("every2", (5, 17)),
                                          ("all", (5, 11, 17)), ("5,17", (5, 17))])
def test_rules_on_gemma3_name_global_layers(rule, layers):
    assert parse_option(f"share={rule}@budget=256").plan(Gemma3Like()).selecting == layers


def test_plan_maps_each_layer_to_its_selection_layer():
    plan = SharedSelection((0, 3), 256).plan_layers(5)
    assert plan.selects == (True, False, False, True, False) and plan.source == (0, 0, 0, 3, 3)
    gemma = SharedSelection(("first",), 256).plan(Gemma3Like())  # indexed as the hook indexes global layers
    assert gemma.layers == (5, 11, 17) and gemma.selects == (True, False, False) and gemma.source == (0, 0, 0)
    assert SharedSelection(("all",), 256).plan_layers(4).every_layer_selects


@pytest.mark.parametrize("spec, message", [
    ("fathom:48@share=0,30@budget=256", r"layer 30 is out of range: the model has 30 layers \(0-29\)"),
    ("fathom:48@share=2,mid@budget=256", r"scanning layers \[0, 1\] come before the first selection layer 2"),
    ("fathom:48@share=0@budget=36", r"budget must be an int > 36"),
    ("fathom:48@share=0@budget=2k", r"budget must be an integer count of positions, got '2k'"),
    ("fathom:48@share=0", r"budget= is missing"),
    ("fathom:48@budget=256", r"share= is missing"),
    ("fathom:48@share=0@budget=256@budget=512", r"budget= given twice"),
    ("fathom:48@share=0@budget=256@layers=1", r"unknown sharing option 'layers'"),
    ("fathom:48@share=0@budget=256@rank=best", r"ranking must be one of"),
    ("fathom:48@share=0@budget=256@attend=some", r"attending must be one of \('all', 'topk'\)"),
    ("fathom:48@share=0,,mid@budget=256", r"empty layer between commas"),
    ("fathom:48@share=0,middle@budget=256", r"unknown layer rule 'middle'"),
    ("fathom:48@share=0@budget", r"expected key=value"),
    ("dense@share=0@budget=256", r"attends every token; there is no selection to share"),
    ("fathom:x@share=0@budget=256", r"budget must be an integer"),
])
def test_bad_specs_say_what_is_wrong(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_spec(spec)[1].resolve(30)


def test_gemma3_local_layers_neither_select_nor_share():
    with pytest.raises(ValueError, match=r"layer 4 does not scan .* scanning layers \[5, 11, 17\]"):
        SharedSelection((4,), 256).plan(Gemma3Like())
    with pytest.raises(ValueError, match=r"\[5\] come before the first selection layer 11 .*\(e.g. share=5,11\)"):
        SharedSelection((11,), 256).plan(Gemma3Like())


def test_budget_against_k_and_context():
    sharing = SharedSelection(("first",), 256)
    sharing.validate(k=256, context=4096)
    with pytest.raises(ValueError, match=r"budget=256 must be >= k=512"):
        sharing.validate(k=512)
    with pytest.raises(ValueError, match=r"budget=256 exceeds the context of 200 positions"):
        sharing.validate(k=128, context=200)


@pytest.mark.parametrize("layers", [(), "0", (True,), (-1,), (0.5,)])
def test_layers_must_be_a_tuple_of_terms(layers):
    with pytest.raises(ValueError, match="SharedSelection"):
        SharedSelection(layers, 256)
