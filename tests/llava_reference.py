"""Tiny checkpoints of the original LLaVA format (``LlavaLlamaForCausalLM``, as MM-FIRE/FIRE ships its models),
written from a tiny transformers LLaVA-NeXT with the mapping done here by hand, independently of
``fire_jax.convert.llava``: the llava-hf model is then the reference for the same weights.
"""

from __future__ import annotations

import json
import os

import numpy as np

from hf_reference import IMAGE_TOKEN, PINPOINTS

#: The original checkpoint's vocabulary: the llava-hf model's without its appended ``<image>`` (id 511).
VOCAB = IMAGE_TOKEN


def original_state(hf, *, tower: bool = True) -> dict[str, np.ndarray]:
    """The weights of a transformers LlavaNextForConditionalGeneration under the original LLaVA key names
    (embedding and lm_head cut to :data:`VOCAB` rows); without ``tower`` the vision tower is left out."""
    renames = [("model.language_model.", "model."), ("model.multi_modal_projector.linear_1.", "model.mm_projector.0."),
               ("model.multi_modal_projector.linear_2.", "model.mm_projector.2."),
               ("model.vision_tower.", "model.vision_tower.vision_tower.vision_model."),
               ("model.image_newline", "model.image_newline"), ("lm_head.", "lm_head.")]
    out = {}
    for key, value in hf.state_dict().items():
        old, new = next((o, n) for o, n in renames if key.startswith(o))
        if old == "model.vision_tower." and not tower:
            continue
        value = value.detach().float().numpy()
        if key in ("model.language_model.embed_tokens.weight", "lm_head.weight"):
            value = value[:VOCAB]
        out[new + key[len(old):]] = np.ascontiguousarray(value)
    return out


def original_config(hf, clip_dir: str, **fields) -> dict:
    """The config.json the LLaVA codebase writes for the same model (Llama fields at the top level)."""
    text = hf.config.text_config
    config = dict(
        architectures=["LlavaLlamaForCausalLM"], model_type="llava_llama", vocab_size=VOCAB,
        hidden_size=text.hidden_size, intermediate_size=text.intermediate_size,
        num_hidden_layers=text.num_hidden_layers, num_attention_heads=text.num_attention_heads,
        num_key_value_heads=text.num_key_value_heads, head_dim=text.head_dim, rms_norm_eps=text.rms_norm_eps,
        rope_theta=500000.0, rope_scaling=None, max_position_embeddings=4096, hidden_act="silu",
        attention_bias=False, tie_word_embeddings=False, torch_dtype="float32",
        mm_vision_tower=clip_dir, mm_hidden_size=hf.config.vision_config.hidden_size,
        mm_projector_type="mlp2x_gelu", mm_vision_select_layer=-2, mm_vision_select_feature="patch",
        image_aspect_ratio="anyres", image_grid_pinpoints=PINPOINTS, mm_patch_merge_type="spatial_unpad",
        mm_use_im_start_end=False, mm_use_im_patch_token=False, tokenizer_padding_side="right",
        use_mm_proj=True, vision_resampler=None)
    config.update(fields)
    return config


def write_clip_folder(hf, directory: str) -> str:
    """A CLIPModel folder (config.json with ``vision_config``, weights ``vision_model.*`` and a text tower)
    whose vision tower is the llava-hf model's."""
    from transformers import CLIPConfig, CLIPModel

    vision = hf.config.vision_config.to_dict()
    config = CLIPConfig(vision_config=vision, text_config=dict(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                                num_hidden_layers=1, num_attention_heads=2),
                        projection_dim=16)
    clip = CLIPModel(config).eval()
    missing = clip.vision_model.load_state_dict(hf.model.vision_tower.state_dict(), strict=True)
    assert not missing.missing_keys
    clip.save_pretrained(directory)
    return directory


def write_original(directory: str, state: dict[str, np.ndarray], config: dict, *, shards: int = 0) -> str:
    """Write config.json and the weights: one model.safetensors (``shards=0``) or ``shards`` torch ``.bin`` files
    with a ``pytorch_model.bin.index.json``, as the LLaVA codebase saves them."""
    import torch
    from safetensors.numpy import save_file

    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    if not shards:
        save_file(state, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
        return directory
    keys = list(state)
    weight_map = {}
    for i in range(shards):
        name = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        part = {k: torch.from_numpy(state[k]) for k in keys[i::shards]}
        torch.save(part, os.path.join(directory, name))
        weight_map.update({k: name for k in part})
    with open(os.path.join(directory, "pytorch_model.bin.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return directory


def tokenizer_without_image(directory: str) -> str:
    """A tokenizer.json of :data:`VOCAB` tokens with Llama-3's special tokens and no ``<image>``."""
    from fire_jax.data.tokenizer import train_tokenizer

    data = json.loads(train_tokenizer(["a photo of a cat on a mat", "Score: 8"], vocab_size=VOCAB + 1).to_str())
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] != "<image>"]
    path = os.path.join(directory, "tokenizer.json")
    with open(path, "w") as f:
        json.dump(data, f)
    return path
