"""Tiny Hugging Face PyTorch LLaVA-NeXT models and inputs for parity tests.

The reference side of every model test: transformers'
``LlavaNextForConditionalGeneration`` with random weights, saved to a
directory and loaded into fire_jax through the converter, so a test checks
model and conversion together.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from flax import nnx

from fire_jax.core.geometry import place_images

PINPOINTS = [[32, 64], [64, 32], [64, 64], [96, 32], [32, 96]]
IMAGE_TOKEN = 511


def tiny_hf_model(directory: str, *, feature_layer: int = -2, rope_scaling: dict | None = None, seed: int = 0):
    """Build, randomise (non-zero norms and biases too) and save a tiny HF LLaVA-NeXT."""
    import torch
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaNextConfig, LlavaNextForConditionalGeneration

    vision = CLIPVisionConfig(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                              intermediate_size=128, projection_dim=32)
    rope = {"rope_type": "default", "rope_theta": 500000.0} if rope_scaling is None else {
        "rope_theta": 500000.0, **rope_scaling}
    text = LlamaConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, intermediate_size=128, rope_parameters=rope,
                       max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False)
    cfg = LlavaNextConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN,
                          image_grid_pinpoints=PINPOINTS, vision_feature_layer=feature_layer,
                          tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlavaNextForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Random everything (incl. norm scales and biases) so no weight's mapping can hide.
            p.copy_(torch.randn_like(p) * (0.5 if p.ndim == 1 else 0.08) + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(directory)
    return model


def make_batch(geometry, image_sizes, text_lengths, seed: int = 0):
    """A right-padded batch in the HF "expanded placeholder" convention.

    ``image_sizes[b]`` is an (h, w) or None (text-only). Each sequence is
    ``[prefix text] [image tokens] [suffix text]``. Returns numpy arrays
    (input_ids, attention_mask, pixel_values [B, max_tiles, 3, H, W], image_index)
    and per-example unpadded lengths.
    """
    rng = np.random.default_rng(seed)
    rows, lengths = [], []
    for size, (pre, post) in zip(image_sizes, text_lengths):
        n_img = 0 if size is None else geometry.num_tokens(size)
        ids = np.concatenate([rng.integers(0, 500, pre), np.full(n_img, IMAGE_TOKEN), rng.integers(0, 500, post)])
        rows.append(ids)
        lengths.append(len(ids))
    seq = max(lengths)
    input_ids = np.zeros((len(rows), seq), np.int64)
    mask = np.zeros((len(rows), seq), np.int64)
    for b, ids in enumerate(rows):
        input_ids[b, :len(ids)] = ids
        mask[b, :len(ids)] = 1
    t = geometry.max_tiles
    pixel_values = rng.standard_normal((len(rows), t, 3, geometry.tile_size, geometry.tile_size)).astype(np.float32)
    sizes = [[] if s is None else [s] for s in image_sizes]
    for b, s in enumerate(sizes):
        pixel_values[b, sum(geometry.num_tiles(x) for x in s):] = 0.0
    image_index = place_images(input_ids, IMAGE_TOKEN, sizes, geometry, t)
    return input_ids, mask, pixel_values, image_index, lengths


def hf_logits(model, input_ids, pixel_values=None, image_size=None):
    """Logits of one unpadded example from the PyTorch model (float32 numpy)."""
    import torch

    kwargs = {"input_ids": torch.as_tensor(input_ids)[None]}
    if image_size is not None:
        kwargs["pixel_values"] = torch.as_tensor(pixel_values)[None]
        kwargs["image_sizes"] = torch.as_tensor([image_size])
    with torch.no_grad():
        return model(**kwargs).logits[0].float().numpy()


@functools.partial(jax.jit, static_argnums=0)
def _call(graphdef, state, args, kwargs):
    return nnx.merge(graphdef, state)(*args, **kwargs)


def jit_call(model, *args, **kwargs):
    """``model(*args, **kwargs)`` as one compiled program (array arguments; models of one structure and
    arguments of one shape share it). Called eagerly, a forward runs op by op, and each of its few hundred
    primitives compiles on its own the first time it meets a shape: most of a model test's compile time."""
    graphdef, state = nnx.split(model)
    return _call(graphdef, state, args, kwargs)


def rel_err(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(ours - ref) / np.linalg.norm(ref))


def load_tool(name: str):
    """A script of ``tools/`` (hf_logits, hf_generate: the reference side run as users run it) as a module."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "tools", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _randomise(model, seed: int, embed_scale: float = 1.0):
    """Every parameter random (norm scales near 1, biases and 1-d weights larger), the embedding scaled."""
    import torch

    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.5 if p.ndim == 1 else 0.08) + (1.0 if "norm" in name else 0.0))
        model.get_input_embeddings().weight.mul_(embed_scale)
    return model


def tiny_vicuna_text_config():
    """A tiny Llama-2 / Vicuna-7B-shaped LLM (lmsys/vicuna-7b-v1.5): RoPE theta 10000, no GQA, RMSNorm eps 1e-5."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=4, head_dim=16, intermediate_size=128,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                       max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False)


def tiny_hf_llava15(directory: str, *, seed: int = 0, embed_scale: float = 1.0):
    """Build, randomise and save a tiny HF LLaVA-1.5 (``LlavaForConditionalGeneration``, llava-1.5-7b-hf's
    class): CLIP 32 px / 8 px patches (16 image tokens, no image_newline), the 2-layer GELU connector, a Vicuna LLM."""
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

    vision = CLIPVisionConfig(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                              intermediate_size=128, projection_dim=32)
    cfg = LlavaConfig(vision_config=vision, text_config=tiny_vicuna_text_config(), image_token_index=IMAGE_TOKEN,
                      image_seq_length=16, vision_feature_layer=-2, tie_word_embeddings=False)
    model = _randomise(LlavaForConditionalGeneration(cfg).eval(), seed, embed_scale)
    model.save_pretrained(directory)
    return model


def tiny_hf_next_vicuna(directory: str, *, seed: int = 0, embed_scale: float = 1.0):
    """Build, randomise and save a tiny HF LLaVA-NeXT-Vicuna (llava-v1.6-vicuna-7b-hf's class and LLM shape)."""
    from transformers import CLIPVisionConfig, LlavaNextConfig, LlavaNextForConditionalGeneration

    vision = CLIPVisionConfig(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                              intermediate_size=128, projection_dim=32)
    cfg = LlavaNextConfig(vision_config=vision, text_config=tiny_vicuna_text_config(), image_token_index=IMAGE_TOKEN,
                          image_grid_pinpoints=PINPOINTS, vision_feature_layer=-2, tie_word_embeddings=False)
    model = _randomise(LlavaNextForConditionalGeneration(cfg).eval(), seed, embed_scale)
    model.save_pretrained(directory)
    return model


def hf_llava15_logits(model, input_ids, pixel_values=None):
    """Logits of one unpadded example from a PyTorch ``LlavaForConditionalGeneration``: ``pixel_values``
    ``[images, 3, H, W]`` (no image_sizes: given them, transformers' LlavaModel splits features as Pixtral's)."""
    import torch

    kwargs = {"input_ids": torch.as_tensor(input_ids)[None]}
    if pixel_values is not None and len(pixel_values):
        kwargs["pixel_values"] = torch.as_tensor(pixel_values)
    with torch.no_grad():
        return model(**kwargs).logits[0].float().numpy()
