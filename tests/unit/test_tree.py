"""trainer_bridge/tree.py: nested param dicts and flat dotted paths."""

import pytest

from trainer_bridge import flatten_params, unflatten_params


def test_flat_and_nested_round_trip():
    flat = {"model.norm.scale": 1, "model.layers_0.mlp.up_proj.kernel": 2, "lm_head.kernel": 3}
    nested = unflatten_params(flat)
    assert nested["model"]["layers_0"]["mlp"]["up_proj"]["kernel"] == 2
    assert flatten_params(nested) == dict(sorted(flat.items()))
    assert flatten_params({"params": nested}) == flatten_params(nested)


@pytest.mark.parametrize(
    "flat, message",
    [
        ({"a.gate_proj": 1, "a.gate_proj.kernel": 2}, r"'a\.gate_proj\.kernel' continues past the leaf 'a\.gate_proj'"),
        ({"a.gate_proj.kernel": 2, "a.gate_proj": 1}, r"'a\.gate_proj' is a leaf and the prefix of other paths"),
    ],
)
def test_a_path_that_is_a_leaf_and_a_prefix_is_named(flat, message):
    with pytest.raises(ValueError, match=message):
        unflatten_params(flat)
