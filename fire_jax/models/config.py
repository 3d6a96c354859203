"""Typed model configuration, built from the ``config.model`` ConfigDict.

Models receive these frozen dataclasses, never the ml_collections tree, so
``fire_jax.models`` can be used (and tested against Hugging Face) on its own.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Mapping

from fire_jax.core.geometry import DEFAULT_PINPOINTS, ImageGeometry

LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


class FrozenMapping(Mapping):
    """A read-only, hashable mapping: config dicts (Llama-3.1 ``rope_scaling``) inside the static graph.

    ``jax.jit`` hashes the graphdef, and with it the model config; a plain dict there raises
    ``TypeError: unhashable type: 'dict'``. Reads like a dict (``x["factor"]``, ``dict(x)``).
    """

    __slots__ = ("_items",)

    def __init__(self, mapping: Mapping[str, Any]):
        self._items = tuple(sorted(dict(mapping).items()))
        hash(self._items)  # values must be hashable too (numbers, strings)

    def __getitem__(self, key: str) -> Any:
        for k, v in self._items:
            if k == key:
                return v
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return (k for k, _ in self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(self._items)

    def __eq__(self, other) -> bool:
        return isinstance(other, Mapping) and dict(self._items) == dict(other)

    def __repr__(self) -> str:
        return f"FrozenMapping({dict(self._items)!r})"


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """CLIP ViT (pre-LN, quick_gelu)."""

    image_size: int = 336
    patch_size: int = 14
    width: int = 1024
    layers: int = 24
    heads: int = 16
    mlp_dim: int = 4096
    layer_norm_eps: float = 1e-5
    feature_layer: int = -2  # index into hidden states (0 = embeddings), as HF's vision_feature_layer

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


@dataclasses.dataclass(frozen=True)
class CLIPTextConfig:
    """CLIP's text transformer (pre-LN, quick_gelu, causal self-attention, learned absolute positions).

    ``eos_token_id``: the sequence embedding is the final hidden state of its first ``eos_token_id`` token, as
    transformers' ``CLIPTextTransformer``; 2, the value of the first OpenAI configs, means the largest id of
    the sequence (their end token is the last of the vocabulary).
    """

    vocab_size: int = 49408
    max_positions: int = 77
    width: int = 512
    layers: int = 12
    heads: int = 8
    mlp_dim: int = 2048
    layer_norm_eps: float = 1e-5
    eos_token_id: int = 49407


@dataclasses.dataclass(frozen=True)
class CLIPConfig:
    """CLIP (Radford et al. 2021): a vision tower and a text tower, each projected to ``projection_dim``, and
    the learned temperature ``logit_scale`` (log 1/0.07 at initialisation, Sec. 2.5)."""

    vision: VisionConfig = VisionConfig()
    text: CLIPTextConfig = CLIPTextConfig()
    projection_dim: int = 512
    logit_scale_init: float = 2.6592
    #: Auxiliary heads on the features LLaVA reads (a vision stage's, ``configs/clip.py``): the classes of each,
    #: as ``fire_jax.data.synthetic.FACT_HEADS``; () for a plain CLIP. Training only: never exported.
    fact_classes: tuple = ()
    fact_pooling: str = "tile"  # what the heads read: "tile" (one read an image) or "token" (see CLIPModel.fact_logits)
    #: Dense heads on each patch of the whole-image tile (``fire_jax.data.synthetic.DENSE_HEADS``), at hidden state
    #: ``dense_layer`` (0: the embeddings), below the layer LLaVA reads. Training only: never exported.
    dense_classes: tuple = ()
    dense_layer: int = 0
    dtype: str = "float32"
    param_dtype: str = "float32"
    attention: str = "auto"

    def __post_init__(self):
        if self.fact_pooling not in ("tile", "token"):
            raise ValueError(f"model.fact_pooling must be 'tile' or 'token', got {self.fact_pooling!r}")
        if self.dense_classes and not 0 < self.dense_layer <= self.vision.layers:
            raise ValueError(f"model.dense_layer must be a hidden state of the tower's, 1..{self.vision.layers}, got "
                             f"{self.dense_layer}")

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> "CLIPConfig":
        """Build from ``config.model`` (``kind="clip"``, which is dropped); unknown keys raise."""
        cfg = dict(cfg.to_dict() if hasattr(cfg, "to_dict") else cfg)
        cfg.pop("kind", None)
        sub = {"vision": VisionConfig, "text": CLIPTextConfig}
        kwargs = {k: _build(sub[k], v, f"model.{k}") if k in sub else v for k, v in cfg.items()}
        for key in ("fact_classes", "dense_classes"):
            kwargs[key] = tuple(int(c) for c in kwargs.get(key, ()))
        return _build(cls, kwargs, "model")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 128320
    dim: int = 4096
    layers: int = 32
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    mlp_dim: int = 14336
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    # None, or the Llama-3.1 "llama3" scaling: factor, low_freq_factor,
    # high_freq_factor, original_max_position_embeddings.
    rope_scaling: FrozenMapping | None = None
    attention_bias: bool = False
    tie_word_embeddings: bool = False  # the LM head is the embedding's transpose (no lm_head weight of its own)

    def __post_init__(self):
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, FrozenMapping):
            object.__setattr__(self, "rope_scaling", FrozenMapping(self.rope_scaling))


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """PEFT-style LoRA: W x + (alpha / rank) * B A dropout(x).

    ``train_layers``: 0 trains the adapters of every LLM layer; N > 0 trains only those of the top N layers.
    The layers below run forward only: their adapters get no
    gradient and the backward pass stops at the lowest trained layer (when nothing below it trains, such as a
    vision tower), so a step costs about (L + N) / 2L of a full one. Their adapters stay as initialised (B = 0,
    a no-op), so exports and merges are exact. PEFT's ``layers_to_transform`` is the same idea.
    """

    rank: int = 64
    alpha: float = 256.0
    dropout: float = 0.05
    targets: tuple[str, ...] = ("q", "k")
    train_layers: int = 0

    def __post_init__(self):
        bad = [t for t in self.targets if t not in LORA_TARGETS]
        if bad:
            raise ValueError(f"lora.targets: unknown target(s) {bad}; choose from {LORA_TARGETS}")
        if self.train_layers < 0:
            raise ValueError(f"lora.train_layers must be >= 0 (0: every layer), got {self.train_layers}")
        object.__setattr__(self, "targets", tuple(self.targets))

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


#: ``LlavaNextConfig.architecture``: transformers' class each one is (the key layout and config.json it reads
#: and writes).
#: Attention kernels (``model.attention``): "auto" (GPUs: ``jax.nn.dot_product_attention`` with JAX's
#: choice, today XLA's generic kernel, which holds the [batch, heads, q, kv] scores; other backends:
#: "cpu"), "xla" (``jax.nn.dot_product_attention(implementation="xla")``), "cudnn" (the fused flash
#: kernel: GPUs, bf16/fp16 only) and "cpu" (``models.layers``' grouped-query kernel in blocks, any backend).
ATTENTION_KERNELS = ("auto", "xla", "cudnn", "cpu")

ARCHITECTURES = {"llava_next": "LlavaNextForConditionalGeneration", "llava": "LlavaForConditionalGeneration"}
#: ``LlavaNextConfig.projector``: the connectors, by the original LLaVA's ``mm_projector_type`` names.
PROJECTORS = ("mlp2x_gelu", "linear")


@dataclasses.dataclass(frozen=True)
class LlavaNextConfig:
    """A LLaVA model: LLaVA-NeXT (``architecture="llava_next"``, anyres tiles and image_newline) or LLaVA-1.5
    (``"llava"``: llava-hf's ``LlavaForConditionalGeneration``, one padded-to-square tile per image, its
    ``grid**2`` features and no image_newline parameter; ``image_mode`` must be "pad")."""

    vision: VisionConfig = VisionConfig()
    llm: LlamaConfig = LlamaConfig()
    lora: LoraConfig | None = LoraConfig()
    image_token_id: int = 128256
    image_grid_pinpoints: tuple[tuple[int, int], ...] = DEFAULT_PINPOINTS
    image_mode: str = "anyres"  # or "pad": one tile per image
    pad_newline: bool = False
    projector_bias: bool = True
    projector: str = "mlp2x_gelu"  # the connector: Linear, GELU, Linear; or "linear" (one Linear, original LLaVA)
    remat: str = "none"  # per-layer rematerialisation policy name, see models.llama.REMAT_POLICIES
    scan_layers: bool = False  # LLM layers stored stacked and run as one lax.scan (training); False: a list (decoding)
    dtype: str = "float32"  # activation / compute dtype
    param_dtype: str = "float32"  # frozen weights' storage dtype
    architecture: str = "llava_next"  # or "llava" (LLaVA-1.5): see the class docstring
    attention: str = "auto"  # the attention kernel, vision tower and LLM: auto, xla, cudnn, cpu (models.layers)
    # How the checkpoint's own code prepares inputs (fire_jax.core.geometry.CONVENTIONS): "transformers"
    # (llava-hf checkpoints) or "release" (the original LLaVA format, as the FIRE release runs its models:
    # pinpoints as (width, height), alpha dropped, the tokenizer's BOS first, inputs cut at max_input_tokens).
    conventions: str = "transformers"
    max_input_tokens: int = 0  # the release's tokenizer_model_max_length: inputs cut there at inference; 0: none

    def __post_init__(self):  # hashable all the way down: jit keys its cache on the graphdef, config included
        object.__setattr__(self, "image_grid_pinpoints", tuple(tuple(p) for p in self.image_grid_pinpoints))
        if self.attention not in ATTENTION_KERNELS:
            raise ValueError(f"model.attention must be one of {ATTENTION_KERNELS}, got {self.attention!r}")
        if self.projector not in PROJECTORS:
            raise ValueError(f"model.projector must be one of {PROJECTORS}, got {self.projector!r}")
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"model.architecture must be one of {sorted(ARCHITECTURES)}, got {self.architecture!r}")
        if self.architecture == "llava" and (self.image_mode != "pad" or self.pad_newline):
            raise ValueError("model.architecture='llava' (LLaVA-1.5) has no image_newline: it needs image_mode='pad' "
                             f"and pad_newline=False, got image_mode={self.image_mode!r}, "
                             f"pad_newline={self.pad_newline}")

    @property
    def has_image_newline(self) -> bool:
        return self.architecture == "llava_next"

    @property
    def geometry(self) -> ImageGeometry:
        return ImageGeometry(
            tile_size=self.vision.image_size, patch_size=self.vision.patch_size,
            pinpoints=self.image_grid_pinpoints, mode=self.image_mode, pad_newline=self.pad_newline,
            conventions=self.conventions)

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> "LlavaNextConfig":
        """Build from ``config.model`` (a ConfigDict or plain dict); unknown keys raise."""
        cfg = dict(cfg.to_dict() if hasattr(cfg, "to_dict") else cfg)
        sub = {"vision": VisionConfig, "llm": LlamaConfig, "lora": LoraConfig}
        kwargs = {}
        for key, value in cfg.items():
            if key in sub:
                kwargs[key] = None if value is None else _build(sub[key], value, f"model.{key}")
            elif key == "image_grid_pinpoints":
                kwargs[key] = tuple(tuple(p) for p in value)
            elif key == "conventions" and not value:  # "": the checkpoint's (weights.build), else the default
                continue
            else:
                kwargs[key] = value
        return _build(cls, kwargs, "model")


def _build(cls, values: Mapping[str, Any], where: str):
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; known: {sorted(names)}")
    return cls(**values)
