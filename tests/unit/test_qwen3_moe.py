"""models/qwen3_moe.py: which layers are sparse."""

from models import qwen3_moe


def test_sparse_layers_follow_mlp_only_layers_and_decoder_sparse_step():
    config = {"num_hidden_layers": 6, "num_experts": 8, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    assert qwen3_moe.sparse_layers(config.get) == {1, 5}
    assert qwen3_moe.sparse_layers({**config, "decoder_sparse_step": 1}.get) == {0, 1, 2, 4, 5}
    assert qwen3_moe.sparse_layers({**config, "num_experts": 0}.get) == frozenset()
