"""CLIP: parity with transformers' CLIPModel, the contrastive loss, checkpoints, and CLIP training."""

import math
import re

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from fire_jax.convert.clip import load_clip_checkpoint, load_clip_vision_tower, save_clip_checkpoint
from fire_jax.models.clip import contrastive_loss
from tests.hf_reference import jit_call, rel_err

EOS = 99  # the tiny text tower's end token (not the largest id, so the pooling must find it, not take argmax)


def tiny_hf_clip(directory: str, seed: int = 0):
    """A tiny random transformers CLIPModel (norm scales and biases random too), saved to ``directory``."""
    import torch
    from transformers import CLIPConfig, CLIPModel

    cfg = CLIPConfig(
        text_config=dict(vocab_size=128, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=16, eos_token_id=EOS, bos_token_id=1,
                         pad_token_id=0),
        vision_config=dict(image_size=32, patch_size=8, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                           num_attention_heads=4),
        projection_dim=24, logit_scale_init_value=2.3)
    torch.manual_seed(seed)
    model = CLIPModel(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name != "logit_scale":
                p.copy_(torch.randn_like(p) * (0.5 if p.ndim == 1 else 0.08) + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(directory)
    return model


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    pixels = rng.standard_normal((3, 3, 32, 32)).astype(np.float32)
    ids = rng.integers(0, EOS, (4, 10))
    lengths = [10, 7, 4, 9]  # the end token last, then padding (id 0): pooling must stop at the end token
    for i, n in enumerate(lengths):
        ids[i, n - 1] = EOS
        ids[i, n:] = 0
    return pixels, ids.astype(np.int32)


@pytest.fixture(scope="module")
def hf_and_ours(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("clip"))
    return directory, tiny_hf_clip(directory), load_clip_checkpoint(directory)


def _hf_outputs(hf, pixels, ids):
    import torch

    with torch.no_grad():
        out = hf(input_ids=torch.tensor(ids, dtype=torch.long), pixel_values=torch.tensor(pixels),
                 attention_mask=torch.tensor((np.arange(ids.shape[1])[None] < np.argmax(ids == EOS, 1)[:, None] + 1)
                                             .astype(np.int64)))
    return out.image_embeds.numpy(), out.text_embeds.numpy(), out.logits_per_image.numpy()


def test_clip_matches_transformers(hf_and_ours):
    """Image and text embeddings and logits_per_image of a tiny random CLIPModel, from its checkpoint."""
    _, hf, ours = hf_and_ours
    pixels, ids = _inputs()
    image, text, logits = _hf_outputs(hf, pixels, ids)
    assert rel_err(ours.image_embeds(jnp.asarray(pixels)), image) < 1e-5
    assert rel_err(ours.text_embeds(jnp.asarray(ids)), text) < 1e-5
    ours_logits = np.asarray(jit_call(ours, jnp.asarray(pixels), jnp.asarray(ids)))
    assert ours_logits.shape == (3, 4)
    assert np.abs(ours_logits - logits).max() < 1e-4
    assert float(ours.logit_scale[...]) == pytest.approx(2.3)


def test_saved_clip_loads_in_transformers(hf_and_ours, tmp_path):
    """save_clip_checkpoint writes what transformers loads back to the same outputs."""
    from transformers import CLIPModel

    _, hf, ours = hf_and_ours
    save_clip_checkpoint(ours, str(tmp_path))
    again = CLIPModel.from_pretrained(str(tmp_path)).eval()
    pixels, ids = _inputs(1)
    for a, b in zip(_hf_outputs(again, pixels, ids), _hf_outputs(hf, pixels, ids)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_contrastive_loss_hand_computed():
    """Two images, two texts: mean of the row-wise and column-wise cross-entropy with the diagonal as labels."""
    logits = jnp.array([[2.0, 0.0], [1.0, 3.0]])
    rows = (-math.log(math.exp(2) / (math.exp(2) + 1)) - math.log(math.exp(3) / (math.exp(1) + math.exp(3)))) / 2
    cols = (-math.log(math.exp(2) / (math.exp(2) + math.exp(1))) - math.log(math.exp(3) / (1 + math.exp(3)))) / 2
    assert float(contrastive_loss(logits)) == pytest.approx((rows + cols) / 2, rel=1e-6)
    assert float(contrastive_loss(jnp.eye(3) * 50.0)) == pytest.approx(0.0, abs=1e-6)


def test_clip_tower_loads_into_llava(hf_and_ours):
    """A CLIP checkpoint's vision tower becomes a LLaVA's: the LLaVA features equal the CLIP tower's."""
    from fire_jax.models import LlavaNext, LlavaNextConfig, LoraConfig, VisionConfig
    from fire_jax.models.config import LlamaConfig

    directory, _, ours = hf_and_ours
    vision = VisionConfig(image_size=32, patch_size=8, width=64, layers=3, heads=4, mlp_dim=128)
    llava = LlavaNext(LlavaNextConfig(vision=vision, lora=LoraConfig(rank=2), image_token_id=511,
                                      llm=LlamaConfig(vocab_size=512, dim=32, layers=1, heads=2, kv_heads=1,
                                                      head_dim=16, mlp_dim=64)), rngs=nnx.Rngs(0))
    load_clip_vision_tower(llava, directory)
    pixels, _ = _inputs()
    np.testing.assert_array_equal(np.asarray(llava.vision_tower(jnp.asarray(pixels))),
                                  np.asarray(ours.vision_tower(jnp.asarray(pixels))))
    wider = LlavaNext(LlavaNextConfig(vision=VisionConfig(image_size=32, patch_size=8, width=32, layers=3, heads=4,
                                                          mlp_dim=128), lora=None, image_token_id=511,
                                      llm=LlamaConfig(vocab_size=512, dim=32, layers=1, heads=2, kv_heads=1,
                                                      head_dim=16, mlp_dim=64)), rngs=nnx.Rngs(0))
    with pytest.raises(Exception, match="vision_config width is 64, the model's vision tower has 32"):
        load_clip_vision_tower(wider, directory)


@pytest.mark.parametrize("record, message", [
    ({"id": "a", "image": "x.png"}, "record 0 (a): field 'caption' must be a non-empty string"),
    ({"id": "b", "image": "missing.png", "caption": "2 red circles."}, "record 0 (b): field 'image': no file"),
])
def test_bad_caption_record_is_one_input_error(tmp_path, record, message):
    import json

    from fire_jax.core.config import InputError, load_config
    from fire_jax.data.captions import CaptionPipeline

    path = tmp_path / "captions.json"
    path.write_text(json.dumps([record]))
    config = load_config("configs/clip.py:tiny").data
    config.sources = dict(captions=dict(json=str(path), image_root=str(tmp_path)))
    with pytest.raises(InputError, match=re.escape(f"{path}: {message}")):
        CaptionPipeline(config, 32, eos_token_id=1, patch_size=8)
