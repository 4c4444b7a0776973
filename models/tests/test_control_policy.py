"""Tests of kestrel_models.control.policy (CPU, tiny configs except one size check)."""

from __future__ import annotations

import pytest
import torch

from kestrel_models.control import ActorCritic, PolicyConfig, build_policy

torch.set_num_threads(1)


def test_reference_sizes_are_the_defaults() -> None:
    cfg = PolicyConfig()
    assert (cfg.obs_dim, cfg.hidden_dims, cfg.num_actions) == (256, (512, 256), 12)
    assert (cfg.lstm_hidden, cfg.history) == (256, 8)
    model = ActorCritic(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    encoder = (256 * 512 + 512) + 2 * 512 + (512 * 256 + 256) + 2 * 256  # Linear + LayerNorm
    lstm = 4 * 256 * (256 + 256) + 2 * 4 * 256  # W_ih, W_hh, b_ih, b_hh
    heads = (256 * 12 + 12) + (256 + 1)
    assert n_params == encoder + lstm + heads
    actions, value = model(torch.zeros(2, cfg.history, cfg.obs_dim))
    assert actions.shape == (2, 12) and value.shape == (2, 1)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"obs_dim": 0}, "obs_dim"),
        ({"num_actions": -1}, "num_actions"),
        ({"lstm_hidden": 2.5}, "lstm_hidden"),
        ({"history": 0}, "history"),
        ({"hidden_dims": ()}, "hidden_dims"),
        ({"hidden_dims": (64, 0)}, "hidden_dims"),
    ],
)
def test_config_validation_names_parameter(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=f"'{name}'"):
        PolicyConfig(**kwargs)


def test_encoder_layout_layernorm_elu() -> None:
    model = ActorCritic(PolicyConfig.tiny())
    kinds = [type(m) for m in model.encoder]
    assert kinds == [torch.nn.Linear, torch.nn.LayerNorm, torch.nn.ELU] * 2
    assert model.encoder[0].in_features == 64 and model.encoder[3].out_features == 32


def test_stateful_steps_equal_window_form() -> None:
    cfg = PolicyConfig.tiny()
    model = build_policy(cfg, seed=3)
    torch.manual_seed(0)
    batch, steps = 3, 6
    obs_hist = torch.randn(batch, steps, cfg.obs_dim)
    with torch.inference_mode():
        actions_win, value_win = model(obs_hist)
        h, c = model.initial_state(batch)
        for t in range(steps):
            actions_st, value_st, h, c = model.step(obs_hist[:, t], h, c)
    assert h.shape == (1, batch, cfg.lstm_hidden)
    torch.testing.assert_close(actions_st, actions_win, atol=1e-5, rtol=0)
    torch.testing.assert_close(value_st, value_win, atol=1e-5, rtol=0)
    # The state matters: a single step from zero state on the last obs gives something else.
    with torch.inference_mode():
        h0, c0 = model.initial_state(batch)
        actions_one, _, _, _ = model.step(obs_hist[:, -1], h0, c0)
    assert (actions_one - actions_win).abs().max() > 1e-4


def test_window_form_uses_history_order() -> None:
    cfg = PolicyConfig.tiny()
    model = build_policy(cfg, seed=1)
    obs = torch.randn(1, cfg.history, cfg.obs_dim)
    with torch.inference_mode():
        a1, _ = model(obs)
        a2, _ = model(obs.flip(1))
    assert (a1 - a2).abs().max() > 1e-5


def test_window_form_rejects_bad_shape() -> None:
    model = build_policy(PolicyConfig.tiny())
    with pytest.raises(ValueError, match=r"\[B, T, 64\]"):
        model(torch.zeros(2, 64))


def test_build_policy_seeded_and_state_dict_roundtrip() -> None:
    cfg = PolicyConfig.tiny()
    rng_before = torch.random.get_rng_state()
    a, b, other = build_policy(cfg, seed=7), build_policy(cfg, seed=7), build_policy(cfg, seed=8)
    assert torch.equal(torch.random.get_rng_state(), rng_before)  # global RNG untouched
    assert torch.equal(a.policy_head.weight, b.policy_head.weight)
    assert not torch.equal(a.policy_head.weight, other.policy_head.weight)
    loaded = build_policy(cfg, seed=99, state_dict=a.state_dict())
    assert torch.equal(loaded.lstm.weight_hh_l0, a.lstm.weight_hh_l0)
    assert not loaded.training
    with pytest.raises(RuntimeError):
        build_policy(PolicyConfig.tiny(num_actions=5), state_dict=a.state_dict())
