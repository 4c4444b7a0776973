"""The tiny planner VLM and inputs the decode-engine tests share (not a test module)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kestrel_models.planner import VisionLanguageModel, get_config


def sharp_tiny(device: str = "cpu") -> VisionLanguageModel:
    """The tiny config, seed-0 weights scaled x30 so that greedy text varies token to token."""
    torch.manual_seed(0)
    m = VisionLanguageModel(get_config("tiny")).to(device).eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.ndim >= 2:
                p.mul_(30.0)
    return m


def prompts(seed: int = 3, lens: tuple[int, ...] = (7, 12, 3)) -> list[list[int]]:
    """Random byte-token prompts of the given lengths."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lens]


def image(seed: int = 1, device: str = "cpu") -> torch.Tensor:
    """A random uint8 [3, 32, 32] image."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8, generator=g).to(device)


def spy(monkeypatch: object, calls: list, module: object, attr: str, name: str) -> None:
    """module.attr replaced (via pytest's monkeypatch) by a wrapper that appends `name` to
    `calls` and then calls the original: what check_kernel_rows' callers record."""
    real = getattr(module, attr)
    monkeypatch.setattr(module, attr, lambda *a: calls.append(name) or real(*a))


def check_kernel_rows(model: VisionLanguageModel, calls: list, one_row: Sequence[object],
                      **kv_kw: object) -> None:
    """A decode step of KVModel(**kv_kw) with more than MLP_KERNEL_ROWS rows gives the default
    KVModel's logits with no spied kernel call (`calls`: what the caller's spies record), and a
    one-row step gives them with `one_row` recorded per layer."""
    from kestrel_models.planner.kvmodel import MLP_KERNEL_ROWS, KVModel

    toks = torch.tensor([prompts()[1][:9]] * 2)
    ref, kv = KVModel(model, 2, 128), KVModel(model, 2, 128, **kv_kw)
    for m in (ref, kv):
        m.forward(m.embed_tokens(toks), torch.zeros(2, dtype=torch.long), slice(0, 2), 9)
    with torch.inference_mode():
        for b in (MLP_KERNEL_ROWS + 1, 1):
            calls.clear()
            torch.testing.assert_close(kv.decode(toks[:b, 3], torch.full((b,), 9), 128),
                                       ref.decode(toks[:b, 3], torch.full((b,), 9), 128),
                                       rtol=1e-4, atol=1e-4)
            assert calls == ([] if b > MLP_KERNEL_ROWS else list(one_row) * len(kv.layers))


def check_step_traces(model: VisionLanguageModel, **kv_kw: object) -> None:
    """torch.compile(fullgraph) of a one-row KVModel(**kv_kw).decode (no graph break) gives
    the eager default step's logits for two steps, under inference_mode as the engine runs
    it."""
    from kestrel_models.planner.kvmodel import KVModel

    toks, pos = torch.tensor([prompts()[1][:9]]), torch.tensor([9])
    ref, kv = KVModel(model, 1, 128), KVModel(model, 1, 128, **kv_kw)
    for m in (ref, kv):
        m.forward(m.embed_tokens(toks), torch.zeros(1, dtype=torch.long), slice(0, 1), 9)
    step = torch.compile(kv.decode, fullgraph=True, dynamic=False, backend="aot_eager")
    with torch.inference_mode():
        for t in range(2):
            torch.testing.assert_close(step(toks[:, t], pos + t, 128),
                                       ref.decode(toks[:, t], pos + t, 128),
                                       rtol=1e-4, atol=1e-4)


def fused_case(b: int, h: int, hkv: int, hd: int, L: int, dtype: torch.dtype, device: str,
               mb: int, seed: int = 0) -> tuple:
    """qkv [B, (H + 2 Hkv) hd], cis [B, hd/2, 2] (cos, sin of random angles), full caches
    k, v [mb, Hkv, L + 8, hd] (mb >= B rows: rows past B must stay untouched), pos [B] with
    row 0 at position 0 and the last row at L - 1."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(b, (h + 2 * hkv) * hd, generator=g).to(device, dtype)
    ang = torch.rand(b, hd // 2, generator=g) * 6.0
    cis = torch.stack([ang.cos(), ang.sin()], -1).to(device)
    kc = torch.randn(mb, hkv, L + 8, hd, generator=g).to(device, dtype)
    vc = torch.randn(mb, hkv, L + 8, hd, generator=g).to(device, dtype)
    pos = torch.randint(0, L, (b,), generator=g)
    pos[0], pos[-1] = 0, L - 1
    return qkv, cis, kc, vc, pos.to(device)
