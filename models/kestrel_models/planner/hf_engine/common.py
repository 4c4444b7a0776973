"""Loading a Hugging Face checkpoint for the decode engine: the checks, the load itself (errors
name the parameter and the cause, whatever was raised), the text decoder mapped into the
engine's packed layout (decoder.py) with the originals released, and image normalisation.

Text decoders the engine runs: Llama, Mistral, Qwen2 and the Qwen2-VL / Qwen2.5-VL text models
(RMSNorm, rotary embeddings, GQA, SwiGLU; qkv biases, sliding-window layers and tied embeddings
included). What they must not have (the engine would compute something else): biases on
o_proj or the MLP, an activation other than SiLU, rope types whose frequencies change with the
sequence length ('dynamic', 'longrope').
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kestrel_models.planner.decoder import DecoderShape, PackedDecoder, pack_layer
from kestrel_models.planner.prefill_layout import split_prompt

__all__ = ["PARAM", "HFLoadError", "Unsupported", "HFDecoder", "read_config", "load_hf_model",
           "pack_text_model", "text_problem", "normalize", "features_of", "preprocessor",
           "check_close"]

PARAM = "hf.model_path"
T = TypeVar("T")
log = logging.getLogger(__name__)
TEXT_TYPES = ("llama", "mistral", "qwen2", "qwen2_vl_text", "qwen2_5_vl_text")
STATIC_ROPE = ("default", "linear", "llama3", "yarn", "mrope")
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


class HFLoadError(ValueError):
    """A checkpoint that cannot be loaded: the message names the parameter and the cause."""


class Unsupported(ValueError):
    """A checkpoint the engine does not run (the message says why); transformers may."""


def where(path: str | Path) -> str:
    return f"parameter '{PARAM}' = {str(path)!r}"


def read_config(path: str | Path) -> dict:
    """config.json of a local checkpoint directory (HFLoadError naming the parameter)."""
    p = Path(path) / "config.json"
    try:
        cfg = json.loads(p.read_text())
    except Exception as exc:  # noqa: BLE001 - missing, unreadable, not JSON: say which
        raise HFLoadError(f"{where(path)}: cannot read config.json: {type(exc).__name__}: "
                          f"{exc}") from exc
    if not isinstance(cfg, dict):
        raise HFLoadError(f"{where(path)}: config.json is not a JSON object")
    return cfg


def load_hf_model(path: str | Path, dtype: torch.dtype | None, cls: Any = None) -> nn.Module:
    """from_pretrained(local_files_only) on the CPU; any failure -> HFLoadError with the cause
    (exception type and message: a corrupted safetensors file, a config the modeling code
    rejects, missing weights)."""
    try:
        import transformers
        cls = cls or transformers.AutoModelForImageTextToText
        kw = {"dtype": dtype} if dtype is not None else {}
        model = cls.from_pretrained(str(path), local_files_only=True, **kw)
    except Exception as exc:  # noqa: BLE001 - whatever the loader raises, say what
        why = (str(exc).strip().splitlines() or [""])[0][:400]
        raise HFLoadError(f"{where(path)}: cannot load the checkpoint: {type(exc).__name__}: "
                          f"{why}") from exc
    return model.eval()


def preprocessor(path: str | Path) -> dict:
    """preprocessor_config.json of the directory ({} when absent or unreadable)."""
    p = Path(path) / "preprocessor_config.json"
    try:
        out = json.loads(p.read_text()) if p.is_file() else {}
    except (OSError, ValueError):
        return {}
    return out if isinstance(out, dict) else {}


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    return cfg.get(name, default) if isinstance(cfg, dict) else getattr(cfg, name, default)


def rope_info(tcfg: Any) -> dict:
    rp = _get(tcfg, "rope_parameters") or _get(tcfg, "rope_scaling") or {}
    return rp if isinstance(rp, dict) else {}


def text_problem(tcfg: Any) -> str | None:
    """Why the engine cannot run this text config (dict or config object), or None."""
    mt = _get(tcfg, "model_type", "?")
    if mt not in TEXT_TYPES:
        return f"text decoder '{mt}' is not one the engine runs ({', '.join(TEXT_TYPES)})"
    act = _get(tcfg, "hidden_act", "silu")
    if act != "silu":
        return f"text decoder activation '{act}' (the engine's MLP is SwiGLU with SiLU)"
    if _get(tcfg, "mlp_bias", False):
        return "text decoder has MLP biases (mlp_bias)"
    rt = rope_info(tcfg).get("rope_type", rope_info(tcfg).get("type", "default"))
    if rt not in STATIC_ROPE:
        return f"rope type '{rt}' changes with the sequence length (the engine's rope is static)"
    return None


def _windows(tcfg: Any, n: int) -> tuple[int, ...]:
    """Sliding window per layer (0 = full attention) as transformers applies it."""
    sw = _get(tcfg, "sliding_window") or 0
    if _get(tcfg, "model_type") == "mistral":
        return (int(sw),) * n
    types = _get(tcfg, "layer_types")
    if not types:
        return (0,) * n
    return tuple(int(sw) if t == "sliding_attention" else 0 for t in types)


def pack_text_model(text_model: nn.Module, lm_head: nn.Module, tcfg: Any,
                    consume: bool = True) -> dict:
    """The HF text model's weights -> PackedDecoder keyword arguments. Layer by layer: the
    packed q|k|v and gate|up are new tensors and the layer's module is dropped right after
    (the originals are released; o_proj, down_proj, the norms, the embedding and lm_head are
    used as they are, no copy). Afterwards text_model.layers is empty. consume=False keeps
    the layers (a second copy of q/k/v and gate/up: for comparisons with transformers)."""
    n_heads, n_kv = int(tcfg.num_attention_heads), int(tcfg.num_key_value_heads)
    hd = int(getattr(tcfg, "head_dim", None) or tcfg.hidden_size // n_heads)
    layers = []
    mods = text_model.layers
    for i in range(len(mods)):
        ly = mods[i]
        a, m = ly.self_attn, ly.mlp
        if getattr(a.o_proj, "bias", None) is not None:
            raise Unsupported("text decoder has an o_proj bias (attention_bias)")

        def w(lin: nn.Module) -> Tensor:
            return lin.weight.detach()

        def b(lin: nn.Module) -> Tensor | None:
            return None if getattr(lin, "bias", None) is None else lin.bias.detach()

        layers.append(pack_layer(w(a.q_proj), w(a.k_proj), w(a.v_proj), w(a.o_proj),
                                 w(m.gate_proj), w(m.up_proj), w(m.down_proj),
                                 ly.input_layernorm.weight.detach(),
                                 ly.post_attention_layernorm.weight.detach(), n_heads, n_kv, hd,
                                 bq=b(a.q_proj), bk=b(a.k_proj), bv=b(a.v_proj)))
        if consume:
            mods[i] = nn.Identity()  # the layer's q, k, v, gate, up go now: one at a time
    if consume:
        text_model.layers = nn.ModuleList()
    emb = text_model.embed_tokens.weight
    tied = lm_head.weight is emb or lm_head.weight.data_ptr() == emb.data_ptr()
    embed = emb.detach()
    rot = text_model.rotary_emb
    mrope = getattr(rot, "mrope_section", None) or rope_info(tcfg).get("mrope_section")
    shape = DecoderShape(int(tcfg.hidden_size), len(layers), n_heads, n_kv, hd,
                         int(embed.shape[0]), float(tcfg.rms_norm_eps),
                         int(tcfg.max_position_embeddings))
    return dict(cfg=shape, embed=embed, layers=layers, norm=text_model.norm.weight.detach(),
                lm_head=embed if tied else lm_head.weight.detach(),
                inv_freq=rot.inv_freq.detach().float(),
                rope_scale=float(getattr(rot, "attention_scaling", 1.0)),
                window=_windows(tcfg, len(layers)),
                mrope_section=tuple(int(x) for x in mrope) if mrope else None)


def normalize(images: Tensor, size: tuple[int, int], mean: Tensor, std: Tensor,
              dtype: torch.dtype) -> Tensor:
    """uint8 [n, 3, H, W] -> float [n, 3, h, w] resized (bilinear, antialias) to size = (h, w),
    scaled to [0, 1] and normalised with mean, std [3]."""
    x = images.float() / 255.0 if images.dtype == torch.uint8 else images.float()
    if tuple(x.shape[-2:]) != tuple(size):
        x = F.interpolate(x, size=size, mode="bilinear", align_corners=False, antialias=True)
    return ((x - mean.view(1, 3, 1, 1)) / std.view(1, 3, 1, 1)).to(dtype)


# ||static - transformers|| / ||transformers|| allowed when a static-shape vision tower is
# checked against transformers' at load, per dtype (bf16/fp16: rounding of a differently
# batched computation over the tower's depth)
CHECK_TOL = {torch.float32: 1e-4, torch.float64: 1e-8}
CHECK_TOL_LOW = 3e-2


def check_close(got: Tensor, want: Tensor, dtype: torch.dtype, what: str) -> None:
    """ValueError unless got matches want within CHECK_TOL of dtype (relative norm)."""
    if got.shape != want.shape:
        raise ValueError(f"{what}: shape {tuple(got.shape)} != transformers' "
                         f"{tuple(want.shape)}")
    got, want = got.float(), want.float()
    err = float((got - want).norm() / want.norm().clamp_min(1e-12))
    tol = CHECK_TOL.get(dtype, CHECK_TOL_LOW)
    if not err <= tol:
        raise ValueError(f"{what}: differs from transformers' (relative error {err:.2g} > "
                         f"{tol:g})")


def features_of(out: Any, n: int) -> Tensor:
    """get_image_features' result, whatever the transformers version returns (a tensor, a
    list of per-image tensors, or an output whose pooler_output is one of those) -> [n, N, D]."""
    feats = getattr(out, "pooler_output", out)
    if isinstance(feats, (list, tuple)):
        feats = torch.stack([f.reshape(-1, f.shape[-1]) for f in feats])
    return feats.reshape(n, -1, feats.shape[-1])


class HFDecoder(PackedDecoder):
    """A checkpoint's decoder in the packed layout; its vision tower and connector stay the
    checkpoint's own modules (`hf`: the transformers model without its decoder layers).
    image_prompt_ids: the tokens one image takes in a prompt whose chat template cannot place
    it (the marker, with the model's begin/end tokens around it where it has them)."""

    graphable_prefill = False  # vision towers run eagerly, once per request, in prefill
    family = ""
    vision_note = ""  # how the vision tower runs, where a family has a choice

    def __init__(self, hf: nn.Module, path: str | Path | None, packed: dict) -> None:
        super().__init__(**packed)
        self.hf, self.path = hf, str(path or "")
        self.architecture = type(hf).__name__
        self.image_prompt_ids: list[int] = []
        pc = preprocessor(path) if path else {}
        mean, std = pc.get("image_mean", self.default_mean), pc.get("image_std", self.default_std)
        dev = self.device
        self.mean = torch.tensor(mean, dtype=torch.float32, device=dev).view(3)
        self.std = torch.tensor(std, dtype=torch.float32, device=dev).view(3)
        self.preprocess_cfg = pc

    default_mean: tuple[float, ...] = CLIP_MEAN
    default_std: tuple[float, ...] = CLIP_STD

    def static_vision(self, build: Callable[[], T]) -> T | None:
        """build(): the family's static-shape vision tower, checked against transformers'
        (raises when it cannot be used). Its result, with the prefill graphable; or None (any
        exception: transformers' eager tower, logged) -- vision_note says which and why."""
        try:
            tower = build()
        except Exception as exc:  # noqa: BLE001 - any mismatch: transformers' tower instead
            why = f"{type(exc).__name__}: {exc}"[:300]
            log.warning("%s: vision tower runs eagerly in transformers (static-shape tower "
                        "not used: %s)", self.family, why)
            self.vision_note = ("vision tower: transformers' (eager; static-shape one not "
                                f"used: {why})")
            self.graphable_prefill = False
            return None
        self.vision_note = "vision tower: static shapes (prefill as a CUDA graph)"
        self.graphable_prefill = True
        return tower

    @property
    def vision_dtype(self) -> torch.dtype:
        return next(p for p in self.hf.parameters() if p.is_floating_point()).dtype

    # ---- the same request for transformers (tests, benchmarks) ----------------------------
    def block_ids(self, shape: tuple[int, ...]) -> list[int]:
        """The token ids of the image block (the processor's placeholders)."""
        return [int(self.image_marker)] * self.image_tokens(shape)  # type: ignore[arg-type]

    def pixel_kwargs(self, images: Tensor) -> dict:
        """uint8 [n, 3, H, W] -> the image inputs of the checkpoint's forward/generate."""
        raise NotImplementedError

    def hf_inputs(self, prompt: list[int], image: Tensor | None) -> dict:
        """One engine request (prompt with the image marker, uint8 [3, H, W] image) as the
        keyword arguments of transformers' generate: input_ids with the image block expanded
        as the processor writes it, attention_mask, and the same pixel inputs the engine's
        prefill gives the vision tower."""
        text, at = split_prompt(prompt, self.image_marker, image is not None)
        ids = text if image is None else [*text[:at], *self.block_ids(tuple(image.shape)),
                                          *text[at:]]
        t = torch.tensor([ids], dtype=torch.long, device=self.device)
        kw = {} if image is None else self.pixel_kwargs(image[None].to(self.device))
        return dict(input_ids=t, attention_mask=torch.ones_like(t), **kw)

    def describe(self) -> str:
        cfg = self.cfg
        extra = [x for x, on in (("qkv bias", self.layers[0]["bqkv"] is not None),
                                 ("tied embeddings", self.tied),
                                 ("sliding window", any(self.window)),
                                 ("M-RoPE", self.mrope_section is not None)) if on]
        return (f"{self.family} ({self.architecture}): decoder {cfg.n_layers} layers, dim "
                f"{cfg.dim}, {cfg.n_heads}/{cfg.n_kv_heads} heads"
                + (f", {', '.join(extra)}" if extra else "")
                + (f"; {self.vision_note}" if self.vision_note else ""))
