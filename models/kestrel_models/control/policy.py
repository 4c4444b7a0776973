"""Recurrent actor-critic policy for joint-space control.

Architecture (the reference sizes are the `PolicyConfig()` defaults):

    obs [B, T, obs_dim]
      -> encoder: per layer Linear -> LayerNorm -> ELU   (obs_dim -> 512 -> 256)
      -> LSTM (1 layer, hidden 256) over the T recent observations
      -> policy head Linear(256 -> num_actions)   actions [B, num_actions], unitless (pre-tanh)
      -> value head  Linear(256 -> 1)             value   [B, 1]

Two forms of the same weights:
- window form `forward(obs_hist)`: runs the LSTM from a zero state over a window of T
  observations and returns the outputs at the last one (training, offline evaluation);
- stateful form `step(obs, h, c)`: one LSTM step per control tick; the caller keeps the state
  (h, c: [1, B, lstm_hidden]) on the device between ticks (the real-time loop).
Stepping T times from the zero state equals the window form over the same T observations.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class PolicyConfig:
    """Sizes of `ActorCritic`. Defaults are the reference sizes; `tiny()` is for CPU tests."""

    obs_dim: int = 256  # observation vector length
    hidden_dims: tuple[int, ...] = (512, 256)  # encoder MLP widths
    num_actions: int = 12  # policy head outputs
    lstm_hidden: int = 256  # LSTM state size H
    history: int = 8  # default window length T of the window form

    def __post_init__(self) -> None:
        for name in ("obs_dim", "num_actions", "lstm_hidden", "history"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"parameter '{name}' = {value!r}: must be an integer >= 1")
        dims = tuple(self.hidden_dims)
        if len(dims) == 0 or any(
            isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in dims
        ):
            raise ValueError(
                f"parameter 'hidden_dims' = {self.hidden_dims!r}: must be a non-empty list of "
                "integers >= 1"
            )
        object.__setattr__(self, "hidden_dims", dims)

    @classmethod
    def tiny(cls, obs_dim: int = 64, num_actions: int = 8) -> PolicyConfig:
        """A small config for CPU tests and demos (~20k parameters)."""
        return cls(
            obs_dim=obs_dim, hidden_dims=(64, 32), num_actions=num_actions, lstm_hidden=32,
            history=4,
        )


class ActorCritic(nn.Module):
    """LayerNorm-MLP encoder + LSTM + policy/value heads (see the module docstring)."""

    def __init__(self, config: PolicyConfig) -> None:
        super().__init__()
        self.config = config
        layers: list[nn.Module] = []
        width = config.obs_dim
        for dim in config.hidden_dims:
            layers += [nn.Linear(width, dim), nn.LayerNorm(dim), nn.ELU()]
            width = dim
        self.encoder = nn.Sequential(*layers)
        self.lstm = nn.LSTM(width, config.lstm_hidden, num_layers=1, batch_first=True)
        self.policy_head = nn.Linear(config.lstm_hidden, config.num_actions)
        self.value_head = nn.Linear(config.lstm_hidden, 1)

    def initial_state(
        self, batch: int = 1, device: torch.device | str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero LSTM state (h, c), each [1, batch, lstm_hidden], float32."""
        if device is None:
            device = self.policy_head.weight.device
        shape = (1, batch, self.config.lstm_hidden)
        return torch.zeros(shape, device=device), torch.zeros(shape, device=device)

    def forward(self, obs_hist: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Window form.

        obs_hist: [B, T, obs_dim] (oldest first). Returns (actions [B, num_actions],
        value [B, 1]) at the last time step, the LSTM starting from a zero state.
        """
        if obs_hist.dim() != 3 or obs_hist.shape[-1] != self.config.obs_dim:
            raise ValueError(
                f"obs_hist shape {tuple(obs_hist.shape)}: expected [B, T, {self.config.obs_dim}]"
            )
        feats = self.encoder(obs_hist)  # [B, T, E]
        out, _ = self.lstm(feats)  # [B, T, H]
        last = out[:, -1]  # [B, H]
        return self.policy_head(last), self.value_head(last)

    def step(
        self, obs: torch.Tensor, h: torch.Tensor, c: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Stateful form: one LSTM step.

        obs: [B, obs_dim]; h, c: [1, B, lstm_hidden]. Returns (actions [B, num_actions],
        value [B, 1], h' [1, B, H], c' [1, B, H]). New tensors are returned; a real-time caller
        copies h', c' into its own preallocated state (`h.copy_(h_new)`).
        """
        feats = self.encoder(obs)  # [B, E]
        lstm = self.lstm
        # One fused LSTM-cell op on the nn.LSTM's own weights (gate order i, f, g, o). On CPU it
        # is ~10x faster than calling nn.LSTM for T=1 (which repacks its weights every call).
        h_new, c_new = torch.lstm_cell(
            feats, (h[0], c[0]), lstm.weight_ih_l0, lstm.weight_hh_l0, lstm.bias_ih_l0,
            lstm.bias_hh_l0,
        )  # [B, H] each
        return (self.policy_head(h_new), self.value_head(h_new), h_new.unsqueeze(0),
                c_new.unsqueeze(0))


def build_policy(
    config: PolicyConfig,
    *,
    seed: int = 0,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> ActorCritic:
    """An `ActorCritic` in eval mode: weights from `state_dict` (strict) or seeded random.

    The seeded init runs under a forked RNG, so the global torch RNG is left untouched.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = ActorCritic(config)
    if state_dict is not None:
        model.load_state_dict(state_dict, strict=True)
    return model.eval()
