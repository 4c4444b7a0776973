"""Users' policy files: TorchScript and ONNX (Isaac Lab style, with and without recurrent
state), state dict + config; names and dims checked at configure with clear messages."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from kestrel_models.control.external import ModelSpec, load_policy
from kestrel_models.control.policy import PolicyConfig, build_policy
from kestrel_models.control.runtimes import BackendUnavailable, create_backend

torch.set_num_threads(1)
OBS, ACT, H = 40, 6, 16


class Mlp(nn.Module):
    def __init__(self, actions: int = ACT) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(OBS, 32), nn.ELU(), nn.Linear(32, actions))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.net(obs)


class Recurrent(nn.Module):
    """Isaac Lab's recurrent export layout: obs [B, D], h/c [layers=1, B, H]."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.lstm = nn.LSTM(OBS, H)
        self.head = nn.Linear(H, ACT)

    def forward(self, obs, h_in, c_in):
        out, (h, c) = self.lstm(obs.unsqueeze(0), (h_in, c_in))
        return self.head(out[0]), h, c


def export_onnx(module: nn.Module, path: Path, recurrent: bool) -> None:
    args = (torch.zeros(1, OBS),) + ((torch.zeros(1, 1, H), torch.zeros(1, 1, H))
                                     if recurrent else ())
    names_in = ["obs", "h_in", "c_in"] if recurrent else ["obs"]
    names_out = ["actions", "h_out", "c_out"] if recurrent else ["actions"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module.eval(), args, str(path), dynamo=False, input_names=names_in,
                          output_names=names_out)


def run_steps(backend, xs):
    out = []
    for x in xs:
        backend.obs_host.copy_(x)
        backend.step()
        out.append(backend.act_host.clone())
    return out


XS = [torch.randn(1, OBS, generator=torch.Generator().manual_seed(k)) for k in range(4)]


def test_torchscript_feedforward(tmp_path: Path) -> None:
    torch.manual_seed(0)
    mlp = Mlp().eval()
    path = tmp_path / "policy.pt"
    torch.jit.script(mlp).save(str(path))
    policy = load_policy(ModelSpec(path=str(path), obs_dim=OBS))
    assert (policy.obs_dim, policy.num_actions, policy.state_shapes) == (OBS, ACT, ())
    got = run_steps(create_backend("cpu_eager", policy, 1), XS)
    with torch.no_grad():
        for x, a in zip(XS, got, strict=True):
            torch.testing.assert_close(a, mlp(x), atol=1e-6, rtol=0)


@pytest.mark.parametrize(("backend", "atol"), [("cpu_eager", 1e-6), ("onnxruntime", 1e-5)])
def test_torchscript_recurrent_state_io(tmp_path: Path, backend: str, atol: float) -> None:
    """Explicit state I/O; on 'onnxruntime' the file is exported from the script module itself
    (not the Python wrapper around it, which the exporter refuses)."""
    if backend == "onnxruntime":
        pytest.importorskip("onnxruntime")
    rec = Recurrent().eval()
    path = tmp_path / "policy.pt"
    torch.jit.trace(rec, (XS[0], torch.zeros(1, 1, H), torch.zeros(1, 1, H))).save(str(path))
    spec = ModelSpec(path=str(path), obs_dim=OBS, state_in_names=("h_in", "c_in"),
                     state_out_names=("h_out", "c_out"), state_shapes=((1, 1, H), (1, 1, H)))
    policy = load_policy(spec)
    assert policy.state_batch_dims == (1, 1) and policy.num_actions == ACT
    got = run_steps(create_backend(backend, policy, 1, cache_dir=str(tmp_path)), XS)
    h = c = torch.zeros(1, 1, H)
    with torch.no_grad():
        for x, a in zip(XS, got, strict=True):
            want, h, c = rec(x, h, c)
            torch.testing.assert_close(a, want, atol=atol, rtol=0)


def test_unexportable_policy_is_a_named_configure_error(tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime")

    class Branchy(nn.Module):
        def forward(self, obs: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("no export here")

    from kestrel_models.control.runtimes import StepPolicy

    policy = StepPolicy(obs_dim=OBS, num_actions=ACT, module=Branchy(), source="TorchScript x")
    with pytest.raises(BackendUnavailable, match=r"'backend' = 'onnxruntime': exporting "
                                                 r"TorchScript x to ONNX failed .*model_path"):
        create_backend("onnxruntime", policy, 1, cache_dir=str(tmp_path))


@pytest.mark.parametrize("recurrent", [False, True], ids=["feedforward", "recurrent"])
def test_onnx_isaac_lab_style(tmp_path: Path, recurrent: bool) -> None:
    module = Recurrent() if recurrent else Mlp()
    path = tmp_path / "policy.onnx"
    export_onnx(module, path, recurrent)
    names = {"state_in_names": ("h_in", "c_in"), "state_out_names": ("h_out", "c_out")} \
        if recurrent else {}
    policy = load_policy(ModelSpec(path=str(path), **names))
    assert (policy.obs_dim, policy.num_actions) == (OBS, ACT)
    assert policy.state_shapes == (((1, 1, H), (1, 1, H)) if recurrent else ())
    got = run_steps(create_backend("onnxruntime", policy, 1), XS)
    h = c = torch.zeros(1, 1, H)
    with torch.no_grad():
        for x, a in zip(XS, got, strict=True):
            if recurrent:
                want, h, c = module(x, h, c)
            else:
                want = module(x)
            torch.testing.assert_close(a, want, atol=1e-5, rtol=0)
    with pytest.raises(BackendUnavailable, match="an ONNX file runs on 'onnxruntime'"):
        create_backend("cpu_eager", policy, 1)


def test_onnx_names_and_dims_checked(tmp_path: Path) -> None:
    path = tmp_path / "policy.onnx"
    export_onnx(Recurrent(), path, recurrent=True)
    with pytest.raises(ValueError, match=r"parameter 'model_input' = 'observations': not among "
                                         r"the model's inputs \['c_in', 'h_in', 'obs'\]"):
        load_policy(ModelSpec(path=str(path), obs_name="observations",
                              state_in_names=("h_in", "c_in"),
                              state_out_names=("h_out", "c_out")))
    with pytest.raises(ValueError, match=r"'model_state_inputs' = \[\]: the model has further "
                                         r"inputs \['c_in', 'h_in'\]"):
        load_policy(ModelSpec(path=str(path)))
    with pytest.raises(ValueError, match="parameter 'num_actions' = 12: the model .* outputs 6"):
        load_policy(ModelSpec(path=str(path), num_actions=12, state_in_names=("h_in", "c_in"),
                              state_out_names=("h_out", "c_out")))
    with pytest.raises(ValueError, match="'model_state_outputs'.*one name per state input"):
        ModelSpec(path=str(path), state_in_names=("h_in",))
    with pytest.raises(ValueError, match="parameter 'model_path' = '/no/such.onnx': no such"):
        load_policy(ModelSpec(path="/no/such.onnx"))


def test_state_dict_plus_config(tmp_path: Path) -> None:
    cfg = PolicyConfig.tiny(obs_dim=OBS, num_actions=ACT)
    path = tmp_path / "weights.pt"
    torch.save(build_policy(cfg, seed=9).state_dict(), path)
    policy = load_policy(ModelSpec(path=str(path), config=cfg))
    assert policy.source == "kestrel ActorCritic" and policy.num_actions == ACT
    ref = build_policy(cfg, seed=9)
    got = run_steps(create_backend("cpu_eager", policy, 1), XS[:1])[0]
    h, c = ref.initial_state(1)
    with torch.no_grad():
        torch.testing.assert_close(got, ref.step(XS[0], h, c)[0], atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="'weights_path'.*does not match the policy dims"):
        load_policy(ModelSpec(path=str(path), config=PolicyConfig.tiny(obs_dim=OBS + 1),
                              path_param="weights_path"))


class RslRlStyleExport(nn.Module):
    """Written the way Isaac Lab's rsl_rl exporter (`_TorchPolicyExporter`) writes policy.pt:
    the class has a feed-forward `forward` and an exported no-op `reset`; for a recurrent
    policy __init__ registers state buffers [layers, 1, H] and binds `forward` and `reset` to
    the LSTM versions on the instance (scripting keeps that forward but not that reset)."""

    def __init__(self, recurrent: bool) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.rnn = nn.LSTM(OBS, H)
        self.actor = nn.Linear(H if recurrent else OBS, ACT)
        if recurrent:
            self.register_buffer("hidden_state", torch.zeros(1, 1, H))
            self.register_buffer("cell_state", torch.zeros(1, 1, H))
            self.forward = self.forward_lstm
            self.reset = self.reset_memory

    def forward_lstm(self, x: torch.Tensor) -> torch.Tensor:
        x, (h, c) = self.rnn(x.unsqueeze(0), (self.hidden_state, self.cell_state))
        self.hidden_state[:] = h
        self.cell_state[:] = c
        return self.actor(x.squeeze(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.actor(x)

    @torch.jit.export
    def reset(self) -> None:
        pass

    def reset_memory(self) -> None:
        self.hidden_state[:] = 0.0
        self.cell_state[:] = 0.0


def _fresh_outputs(xs, recurrent: bool = True) -> list[torch.Tensor]:
    """The export's outputs from its load-time (zero) state: a fresh module, same weights."""
    ref = RslRlStyleExport(recurrent).eval()
    with torch.no_grad():
        return [ref(x) for x in xs]


def _rsl_rl_policy(tmp_path: Path, recurrent: bool = True):
    path = tmp_path / "policy.pt"
    torch.jit.script(RslRlStyleExport(recurrent).eval()).save(str(path))
    return load_policy(ModelSpec(path=str(path), obs_dim=OBS))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_rsl_rl_internal_state_is_reset(tmp_path: Path, device: str) -> None:
    """Warm-up (and the loader's probe call) must not leave state behind, and reset_state must
    restore the file's own buffers: else a NaN once would hold the robot for good. On CUDA
    through the captured graph (the reset writes the buffers the graph reads, in place)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    policy = _rsl_rl_policy(tmp_path)
    assert policy.state_shapes == () and "reset" in policy.extra
    assert policy.extra["state_buffers"] == ["hidden_state", "cell_state"]
    backend = create_backend("cpu_eager" if device == "cpu" else "cuda_graph", policy, 1)
    want = _fresh_outputs(XS)
    tol = {"atol": 1e-6 if device == "cpu" else 1e-4, "rtol": 0}
    got = run_steps(backend, XS)  # after warm-up's reset
    for a, w in zip(got, want, strict=True):
        torch.testing.assert_close(a, w, **tol)
    assert not torch.allclose(got[0], got[1])  # the state did carry over between steps
    backend.reset_state(0)
    for a, w in zip(run_steps(backend, XS), want, strict=True):  # after a reset
        torch.testing.assert_close(a, w, **tol)
    with pytest.raises(ValueError, match=r"parameter 'robots': 2 robots .* own buffers"):
        create_backend("cpu_eager", policy, 2)
    with pytest.raises(BackendUnavailable, match=r"own buffers.*policy.onnx"):
        create_backend("onnxruntime", policy, 1, cache_dir=str(tmp_path))


@pytest.mark.slow
def test_rsl_rl_feedforward_export_is_stateless(tmp_path: Path) -> None:
    """The feed-forward export's no-op reset() says nothing about state: no buffers change, so
    the file batches several robots and exports to ONNX like any other."""
    pytest.importorskip("onnxruntime")
    policy = _rsl_rl_policy(tmp_path, recurrent=False)
    assert "reset" not in policy.extra
    want = _fresh_outputs(XS, recurrent=False)
    for name in ("cpu_eager", "onnxruntime"):
        backend = create_backend(name, policy, 2, cache_dir=str(tmp_path))
        for x, w in zip(XS, want, strict=True):
            backend.obs_host.copy_(torch.cat([x, x]))
            backend.step()
            torch.testing.assert_close(backend.act_host[1:], w, atol=1e-5, rtol=0)


def _scripted_bytes(tmp_path: Path) -> bytes:
    path = tmp_path / "good.pt"
    torch.jit.script(Mlp().eval()).save(str(path))
    return path.read_bytes()


@pytest.mark.parametrize(("kind", "reason"), [
    ("empty", "the file is empty"),
    ("random", "not a TorchScript file nor a state_dict saved by torch.save"),
    ("truncated", "not a TorchScript file nor a state_dict saved by torch.save"),
    ("pickled_module", "holds Python objects besides tensors"),
])
def test_unloadable_policy_file_names_model_path_and_never_unsafe_loading(
        tmp_path: Path, kind: str, reason: str) -> None:
    """A user's policy.pt that cannot be loaded: the error names the parameter the user set
    (model_path, not the reference policy's weights_path) with the reason, and never repeats
    torch's advice to load with weights_only=False (which would run pickled code)."""
    path = tmp_path / "policy.pt"
    if kind == "empty":
        path.write_bytes(b"")
    elif kind == "random":
        path.write_bytes(bytes(range(256)) * 8)
    elif kind == "truncated":
        path.write_bytes(_scripted_bytes(tmp_path)[:300])
    else:
        torch.save(Mlp(), path)  # a whole pickled module, not tensors
    with pytest.raises(ValueError) as err:
        load_policy(ModelSpec(path=str(path), obs_dim=OBS))
    text = str(err.value)
    assert text.startswith(f"parameter 'model_path' = '{path}': ") and reason in text, text
    assert "weights_only" not in text and "weights_path" not in text, text
    assert "\n" not in text, text


def test_torchscript_obs_dim_mismatch_says_both_sizes(tmp_path: Path) -> None:
    """As for ONNX files: the parameter (obs_dim) and both sizes, no TorchScript traceback."""
    path = tmp_path / "policy.pt"
    torch.jit.script(Mlp().eval()).save(str(path))
    with pytest.raises(ValueError) as err:
        load_policy(ModelSpec(path=str(path), obs_dim=OBS + 2))
    assert str(err.value) == (f"parameter 'obs_dim' = {OBS + 2}: the model '{path}' takes "
                              f"{OBS} values")


def test_torchscript_obs_dim_mismatch_at_a_normaliser_says_both_sizes(tmp_path: Path) -> None:
    """rsl_rl's export starts with the observation normaliser (elementwise), not a Linear."""

    class Normalised(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("mean", torch.zeros(OBS))
            self.actor = nn.Linear(OBS, ACT)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.actor(x - self.mean)

    path = tmp_path / "policy.pt"
    torch.jit.script(Normalised().eval()).save(str(path))
    with pytest.raises(ValueError, match=rf"^parameter 'obs_dim' = {OBS - 3}: the model "
                                         rf"'.*' takes {OBS} values$"):
        load_policy(ModelSpec(path=str(path), obs_dim=OBS - 3))
