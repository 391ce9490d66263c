import pytest
import torch

from offloadlab import memory
from offloadlab.models import GPTConfig, TinyGPT


@pytest.mark.parametrize(
    "name, total",
    [
        ("mixed-adam", 16),
        ("mixed-adam-fp32-grads", 18),
        ("fp32-adam", 16),
        ("bf16-adam", 8),
        ("sgd-momentum", 12),
        ("adam-8bit", 10 + 8 / 2048),
    ],
)
def test_every_recipe_total(name, total):
    recipe = memory.get_recipe(name)
    assert recipe.total == pytest.approx(total)
    assert set(recipe.bytes_per_param) <= set(memory.KINDS)
    assert memory.state_bytes(1e9, name).total_bytes == pytest.approx(total * 1e9)


def test_mixed_adam_breakdown_and_the_160_gb_wall():
    state = memory.state_bytes(10e9)
    assert state.recipe == "mixed-adam"
    assert state.by_kind == {
        "weights": 20e9,
        "gradients": 20e9,
        "master_weights": 40e9,
        "first_moment": 40e9,
        "second_moment": 40e9,
    }
    assert state.total_bytes == 160e9
    assert memory.fitting_gpus(state.total_bytes) == []
    assert memory.fitting_gpus(80e9) == ["80 GB", "141 GB"]
    payload = state.to_dict()
    assert payload["total_bytes"] == 160e9 and payload["fits"]["141 GB"] is False


def test_card_sizes_are_what_the_cards_report_not_their_names():
    # An "80 GB" card carries 80 GiB of HBM and reports about 79.2 GiB: more than 80e9 bytes.
    eighty = memory.GPU_SIZES["80 GB"]
    assert 79 * 2**30 < eighty < 80 * 2**30 and eighty > 80e9
    assert 39 * 2**30 < memory.GPU_SIZES["40 GB"] < 40 * 2**30
    assert 139 * 2**30 < memory.GPU_SIZES["141 GB"] < 141e9 + 10e9
    # So 160 GB of state is 1.9 times an 80 GB card, not 2, and the card holds 5.3 B parameters.
    assert round(160e9 / eighty, 2) == 1.88 and round(eighty / 16 / 1e9, 1) == 5.3
    assert memory.state_bytes(10e9).to_dict()["gpu_reported_bytes"]["80 GB"] == eighty


@pytest.mark.parametrize(
    "name, weight, gradient, optimizer",
    [
        ("mixed-adam", 2, 2, 12),
        ("fp32-adam", 4, 4, 8),
        ("bf16-adam", 2, 2, 4),
        ("sgd-momentum", 4, 4, 4),
        ("adam-8bit", 2, 2, 6 + 8 / 2048),
    ],
)
def test_bytes_each_part_of_the_step_touches(name, weight, gradient, optimizer):
    recipe = memory.get_recipe(name)
    assert (recipe.weight_bytes, recipe.gradient_bytes) == (weight, gradient)
    assert recipe.optimizer_bytes == pytest.approx(optimizer)
    assert recipe.optimizer_bytes + weight + gradient == pytest.approx(recipe.total)


def test_bad_recipe_and_params():
    with pytest.raises(ValueError, match="^recipe: expected one of mixed-adam"):
        memory.get_recipe("adamw")
    with pytest.raises(ValueError, match="^params: "):
        memory.state_bytes(-3)
    with pytest.raises(ValueError, match="^params: "):
        memory.state_bytes("10 GB")


@pytest.mark.parametrize(
    "config",
    [
        GPTConfig(),
        GPTConfig(layers=2, hidden=96, heads=3, vocab=1000, seq=64, tied_embeddings=False),
        GPTConfig(layers=1, hidden=64, heads=8, vocab=50, seq=16, mlp_ratio=2),
    ],
)
def test_transformer_count_matches_a_real_model(config):
    model = TinyGPT(config)
    assert sum(p.numel() for p in model.parameters()) == config.params


def test_transformer_count_known_shape():
    # GPT-2 small: 12 layers, h=768, V=50257, 1024 positions, tied head -> 124,439,808 parameters.
    assert memory.transformer_params(12, 768, 50257, positions=1024) == 124_439_808


def test_transformer_count_bad_arguments():
    with pytest.raises(ValueError, match="^layers: "):
        memory.transformer_params(0, 768, 50257)
    with pytest.raises(ValueError, match="^hidden: "):
        memory.transformer_params(2, 76.5, 50257)
    with pytest.raises(ValueError, match="^mlp_ratio: "):
        memory.transformer_params(2, 768, 50257, mlp_ratio=-1)
    with pytest.raises(ValueError, match="^heads: "):
        GPTConfig(hidden=100, heads=3)


def test_activation_estimate():
    kept = memory.activation_bytes_per_layer(2, 1024, 2048, 16)
    assert kept == 1024 * 2 * 2048 * (34 + 5 * 16 * 1024 / 2048)
    assert memory.activation_bytes_per_layer(2, 1024, 2048, 16, "selective") == 34 * 1024 * 2 * 2048
    assert memory.activation_bytes_per_layer(2, 1024, 2048, 16, "full") == 2 * 1024 * 2 * 2048
    with pytest.raises(ValueError, match="^recompute: "):
        memory.activation_bytes_per_layer(2, 1024, 2048, 16, "some")
    with pytest.raises(ValueError, match="^batch: "):
        memory.activation_bytes_per_layer(0, 1024, 2048, 16)


def _step(model, optimizer, config):
    tokens = torch.randint(0, config.vocab, (2, config.seq))
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    optimizer.step()


def test_measure_state_fp32_adamw_after_one_step():
    config = GPTConfig(layers=2, hidden=64, heads=4, vocab=128, seq=32)
    model = TinyGPT(config)
    optimizer = torch.optim.AdamW(model.parameters())
    before = memory.measure_state(model, optimizer)
    assert before == {"weights": 4 * config.params}
    _step(model, optimizer, config)
    measured = memory.measure_state(model, optimizer)
    expected = memory.state_bytes(config.params, "fp32-adam").by_kind
    for kind, size in expected.items():
        assert measured[kind] == size
    # AdamW's step counters: one fp32 scalar per parameter tensor.
    assert measured["other"] == 4 * len(list(model.parameters()))


def test_measure_state_mixed_precision_with_master_copies():
    config = GPTConfig(layers=1, hidden=32, heads=2, vocab=64, seq=16)
    model = TinyGPT(config).to(torch.bfloat16)
    masters = [p.detach().float().requires_grad_() for p in model.parameters()]
    optimizer = torch.optim.AdamW(masters)
    tokens = torch.randint(0, config.vocab, (2, config.seq))
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    for master, p in zip(masters, model.parameters()):
        master.grad = p.grad.float()
    optimizer.step()
    measured = memory.measure_state(model, optimizer)
    assert measured["master_gradients"] == 4 * config.params
    for master in masters:
        master.grad = None
    measured = memory.measure_state(model, optimizer)
    for kind, size in memory.state_bytes(config.params, "mixed-adam").by_kind.items():
        assert measured[kind] == size
    assert "master_gradients" not in measured


def test_measure_state_sgd_and_shared_storage():
    layer = torch.nn.Linear(8, 8, bias=False)
    model = torch.nn.Sequential(layer, layer)  # the same weight twice
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(3, 8)).sum().backward()
    optimizer.step()
    assert memory.measure_state(model, optimizer) == {
        "weights": 256,
        "gradients": 256,
        "first_moment": 256,
    }
    assert memory.measure_state(model) == {"weights": 256, "gradients": 256}
