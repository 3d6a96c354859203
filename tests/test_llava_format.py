"""The original LLaVA format (LlavaLlamaForCausalLM, MM-FIRE/FIRE's checkpoints) against transformers' llava-hf
model of the same weights (fire_jax/convert/llava.py)."""

import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from fire_jax.core.cli import input_errors_end_in_one_line
from fire_jax.core.config import InputError
from fire_jax.convert import llava
from fire_jax.convert.load import load_checkpoint
from fire_jax.data.chat import ChatTokenizer, Message
from fire_jax.infer.decode import generate
from fire_jax.infer.sampling import SamplingParams
from fire_jax.models import count_params
from hf_reference import IMAGE_TOKEN, hf_logits, jit_call, load_tool, make_batch, rel_err, tiny_hf_model
from llava_reference import (VOCAB, original_config, original_state, tokenizer_without_image, write_clip_folder,
                             write_original)

SIZES = [(40, 70), (70, 40), None, (30, 90), (64, 64)]
TEXT = [(3, 5), (4, 2), (9, 0), (2, 7), (1, 1)]
NEW = 8


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """(llava-hf model, its CLIP folder, the original-format folder with the tower, the same without it as .bin
    shards)."""
    root = tmp_path_factory.mktemp("llava_format")
    hf = tiny_hf_model(str(root / "hf"))
    with torch.no_grad():  # larger embeddings: greedy outputs vary instead of repeating one token
        hf.model.language_model.embed_tokens.weight.mul_(8.0)
    clip = write_clip_folder(hf, str(root / "clip"))
    folder = write_original(str(root / "llava"), original_state(hf), original_config(hf, clip))
    tokenizer_without_image(folder)
    shards = write_original(str(root / "llava_bin"), original_state(hf, tower=False), original_config(hf, clip),
                            shards=2)
    return hf, clip, folder, shards


@pytest.fixture(scope="module")
def model(release):
    return load_checkpoint(release[2])


def test_config_follows_the_release_fields(model):
    cfg = model.cfg
    assert cfg.architecture == "llava_next" and cfg.image_mode == "anyres"
    assert cfg.image_token_id == VOCAB == cfg.llm.vocab_size  # <image>: the next free id, outside the logits
    assert (cfg.llm.heads, cfg.llm.kv_heads, cfg.llm.rope_theta) == (4, 2, 500000.0)
    assert cfg.vision.feature_layer == -2 and cfg.vision.width == 64 and cfg.vision.image_size == 32
    assert cfg.image_grid_pinpoints == ((32, 64), (64, 32), (64, 64), (96, 32), (32, 96))


def test_logits_equal_transformers_on_the_llava_hf_weights(release, model):
    hf = release[0]
    ids, mask, pv, idx, lengths = make_batch(model.cfg.geometry, SIZES, TEXT)
    assert IMAGE_TOKEN == model.cfg.image_token_id  # the llava-hf model's image id is the next free one too
    ours = np.asarray(jit_call(model, jnp.asarray(ids), jnp.asarray(pv), jnp.asarray(idx), jnp.asarray(mask)))
    assert ours.shape[-1] == VOCAB
    errors = []
    for b, size in enumerate(SIZES):
        tiles = 0 if size is None else model.cfg.geometry.num_tiles(size)
        ref = hf_logits(hf, ids[b, :lengths[b]], pv[b, :tiles], size)[:, :VOCAB]
        errors.append(rel_err(ours[b, :lengths[b]], ref))
    print("relative logit errors (checkpoint vocabulary):", errors)
    assert max(errors) < 1e-5, errors


def test_greedy_tokens_equal_transformers(release, model):
    hf = release[0]
    ids, _, pv, _, lengths = make_batch(model.cfg.geometry, SIZES, TEXT)
    prompts = [ids[b, :n].tolist() for b, n in enumerate(lengths)]
    ours = generate(model, prompts, pixel_values=pv, image_sizes=SIZES,
                    sampling=SamplingParams(max_tokens=NEW, stop_ids=())).tokens
    for b, size in enumerate(SIZES):
        kwargs = dict(input_ids=torch.as_tensor(prompts[b])[None])
        if size is not None:
            tiles = model.cfg.geometry.num_tiles(size)
            kwargs.update(pixel_values=torch.as_tensor(pv[b:b + 1, :tiles]), image_sizes=torch.as_tensor([size]))
        with torch.no_grad():  # transformers' vocabulary has <image>; the checkpoint's does not
            out = hf.generate(**kwargs, max_new_tokens=NEW, do_sample=False, suppress_tokens=[IMAGE_TOKEN],
                              pad_token_id=0, eos_token_id=None)
        np.testing.assert_array_equal(ours[b], out[0, len(prompts[b]):].numpy())
    assert len({tuple(r) for r in ours}) > 1 and IMAGE_TOKEN not in ours


def test_tower_from_the_clip_folder_and_bin_shards_load_the_same_weights(release, model):
    from flax import nnx

    other = load_checkpoint(release[3])
    ours, theirs = nnx.to_flat_state(nnx.state(model, nnx.Param)), nnx.to_flat_state(nnx.state(other, nnx.Param))
    assert len(ours) == len(theirs) and count_params(model) == count_params(other)
    for (path, a), (_, b) in zip(ours, theirs):
        np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]), err_msg=str(path))


def test_tokenizer_without_image_gets_the_next_id(release, model):
    chat = ChatTokenizer.from_file(os.path.join(release[2], "tokenizer.json"), model.cfg.geometry, template="llama3")
    assert chat.image_token_id == VOCAB == model.cfg.image_token_id
    encoded = chat.encode([Message("user", "a cat", images=1)], (40, 70), add_generation_prompt=True)
    assert (encoded.input_ids == VOCAB).sum() == model.cfg.geometry.num_tokens((40, 70))
    assert chat.decode([VOCAB]) == "<image>"


def test_known_tower_shape_without_a_clip_folder(release):
    hf = json.load(open(os.path.join(release[2], "config.json")))
    hf["mm_vision_tower"] = "openai/clip-vit-large-patch14-336"
    cfg = llava.config_from_llava(hf, release[2])
    assert (cfg.vision.image_size, cfg.vision.patch_size, cfg.vision.width, cfg.vision.layers) == (336, 14, 1024, 24)
    hf["mm_vision_tower"] = "someone/clip"
    with pytest.raises(InputError, match="mm_vision_tower"):
        llava.config_from_llava(hf, release[2])


def test_pad_and_flat_layouts(release):
    hf = json.load(open(os.path.join(release[2], "config.json")))
    pad = llava.config_from_llava(dict(hf, image_aspect_ratio="pad"), release[2])
    assert (pad.architecture, pad.image_mode, pad.pad_newline) == ("llava_next", "pad", False)
    flat = llava.config_from_llava(dict(hf, image_aspect_ratio="pad", mm_patch_merge_type="flat"), release[2])
    assert (flat.architecture, flat.image_mode) == ("llava", "pad")
    with pytest.raises(InputError, match="mm_patch_merge_type='flat'"):
        llava.config_from_llava(dict(hf, mm_patch_merge_type="flat"), release[2])
    with pytest.raises(InputError, match="mm_projector_type"):
        llava.config_from_llava(dict(hf, mm_projector_type="mlp3x_gelu"), release[2])
    with pytest.raises(InputError, match="mm_vision_select_feature"):
        llava.config_from_llava(dict(hf, mm_vision_select_feature="cls_patch"), release[2])
    with pytest.raises(InputError, match="mm_use_im_start_end"):
        llava.config_from_llava(dict(hf, mm_use_im_start_end=True), release[2])


def test_llava15_image_seq_length_is_a_warning(tmp_path):
    from hf_reference import tiny_hf_llava15

    tiny_hf_llava15(str(tmp_path))
    config = json.load(open(tmp_path / "config.json"))
    config["image_seq_length"] = 576  # llava-1.5-7b-hf's value on a tower of 16 patches
    json.dump(config, open(tmp_path / "config.json", "w"))
    with pytest.warns(UserWarning, match="image_seq_length=576.*using 16"):
        model = load_checkpoint(str(tmp_path), lora=None)
    assert model.cfg.geometry.tokens_per_tile == 16


# --------------------------------------------------------------------------- bad folders: one line, exit 2

def _tool_error(capsys, argv) -> str:
    """The one stderr line tools/hf_logits.py ends with (exit 2) on ``argv``."""
    with pytest.raises(SystemExit) as exit_info:
        input_errors_end_in_one_line("hf_logits")(load_tool("hf_logits").main)(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def _inputs(tmp_path):
    path = str(tmp_path / "in.npz")
    np.savez(path, input_ids=np.array([[1, 2, 3]]))
    return ["--inputs", path, "--out", str(tmp_path / "out.npz")]


def test_missing_key_names_the_folder_and_the_key(release, tmp_path, capsys):
    state = original_state(release[0])
    del state["model.layers.1.mlp.up_proj.weight"]
    folder = write_original(str(tmp_path / "m"), state, original_config(release[0], release[1]))
    err = _tool_error(capsys, ["--model", folder] + _inputs(tmp_path))
    assert folder in err and "'model.layers.1.mlp.up_proj.weight'" in err


@pytest.mark.parametrize("shards", [0, 2], ids=["safetensors", "bin"])
def test_truncated_shard_names_the_file(release, tmp_path, capsys, shards):
    folder = write_original(str(tmp_path / "t"), original_state(release[0]), original_config(release[0], release[1]),
                            shards=shards)
    name = "model.safetensors" if not shards else "pytorch_model-00002-of-00002.bin"
    path = os.path.join(folder, name)
    data = open(path, "rb").read()
    open(path, "wb").write(data[:len(data) // 2])
    err = _tool_error(capsys, ["--model", folder] + _inputs(tmp_path))
    assert path in err and "truncated" in err


def test_bin_weights_without_torch_is_one_line(release, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    path = os.path.join(release[3], "pytorch_model-00001-of-00002.bin")
    with pytest.raises(InputError, match=f"{path}: reading PyTorch .bin weights needs torch"):
        next(llava.read_torch(path))


def test_unknown_key_names_the_key(release, tmp_path):
    state = dict(original_state(release[0]), **{"model.mm_projector.4.weight": np.zeros((2, 2), np.float32)})
    folder = write_original(str(tmp_path / "u"), state, original_config(release[0], release[1]))
    with pytest.raises(InputError, match=r"'model\.mm_projector\.4\.weight'"):
        load_checkpoint(folder)


def test_no_tower_anywhere_is_one_error(release, tmp_path, monkeypatch):
    tower = release[0].config.vision_config
    monkeypatch.setitem(llava.KNOWN_TOWERS, "someone/tiny-clip", dict(
        hidden_size=tower.hidden_size, intermediate_size=tower.intermediate_size, num_attention_heads=4,
        num_hidden_layers=tower.num_hidden_layers, image_size=tower.image_size, patch_size=tower.patch_size))
    config = original_config(release[0], "someone/tiny-clip")
    folder = write_original(str(tmp_path / "n"), original_state(release[0], tower=False), config)
    with pytest.raises(InputError, match="no vision tower weights.*names no local CLIP folder"):
        load_checkpoint(folder)
    assert load_checkpoint(release[2]).cfg.vision.heads == 4  # the same config with the tower loads


# --------------------------------------------------------------------------- the release's LoRA teacher

RANK, ALPHA = 4, 8.0


@pytest.fixture(scope="module")
def teacher(release, tmp_path_factory):
    """(LoRA folder on the original-format base, the llava-hf model with the same merge done by hand in torch)."""
    import copy

    from safetensors.torch import save_file

    hf, _, base, _ = release
    folder = str(tmp_path_factory.mktemp("teacher"))
    gen = torch.Generator().manual_seed(7)
    expected = copy.deepcopy(hf)
    factors, non_lora = {}, {}
    with torch.no_grad():
        for i in range(hf.config.text_config.num_hidden_layers):
            attn = expected.model.language_model.layers[i].self_attn
            for proj in ("q_proj", "k_proj", "v_proj"):
                weight = getattr(attn, proj).weight
                a = torch.randn(RANK, weight.shape[1], generator=gen) * 0.2
                b = torch.randn(weight.shape[0], RANK, generator=gen) * 0.2
                prefix = f"base_model.model.model.layers.{i}.self_attn.{proj}"
                factors[f"{prefix}.lora_A.weight"], factors[f"{prefix}.lora_B.weight"] = a, b
                weight += (ALPHA / RANK) * (b @ a)  # PEFT's merge_and_unload
        for index, linear in (("0", expected.model.multi_modal_projector.linear_1),
                              ("2", expected.model.multi_modal_projector.linear_2)):
            for name in ("weight", "bias"):  # the trained connector, as non_lora_trainables.bin stores it
                value = torch.randn(getattr(linear, name).shape, generator=gen) * 0.1
                non_lora[f"base_model.model.model.mm_projector.{index}.{name}"] = value
                getattr(linear, name).copy_(value)
    save_file(factors, os.path.join(folder, "adapter_model.safetensors"))
    torch.save(non_lora, os.path.join(folder, "non_lora_trainables.bin"))
    json.dump(dict(peft_type="LORA", r=RANK, lora_alpha=ALPHA, lora_dropout=0.05, bias="none",
                   target_modules=["q_proj", "k_proj", "v_proj"], base_model_name_or_path=base, task_type="CAUSAL_LM"),
              open(os.path.join(folder, "adapter_config.json"), "w"))
    shutil.copy(os.path.join(base, "config.json"), folder)
    return folder, expected


def _logit_errors(model, hf):
    ids, mask, pv, idx, lengths = make_batch(model.cfg.geometry, SIZES, TEXT)
    ours = np.asarray(jit_call(model, jnp.asarray(ids), jnp.asarray(pv), jnp.asarray(idx), jnp.asarray(mask)))
    errors = []
    for b, size in enumerate(SIZES):
        tiles = 0 if size is None else model.cfg.geometry.num_tiles(size)
        errors.append(rel_err(ours[b, :lengths[b]], hf_logits(hf, ids[b, :lengths[b]], pv[b, :tiles], size)[:, :VOCAB]))
    return errors


def test_lora_teacher_equals_the_merge_by_hand(release, teacher):
    folder, expected = teacher
    model = load_checkpoint(release[2], adapter=folder)
    kernel = np.asarray(model.language_model.model.layers[1].self_attn.k_proj.kernel[...])
    np.testing.assert_allclose(kernel, expected.model.language_model.layers[1].self_attn.k_proj.weight.detach().numpy().T,
                               rtol=0, atol=1e-6)
    errors = _logit_errors(model, expected)
    print("LoRA teacher vs merge by hand, relative logit errors:", errors)
    assert max(errors) < 1e-5, errors
    assert min(_logit_errors(load_checkpoint(release[2]), expected)) > 1e-2  # the merge changed them


def test_lora_folder_alone_and_config_init_adapter(release, teacher):
    from flax import nnx

    from fire_jax.weights.build import build_model
    from fire_jax.core.config import load_config
    from fire_jax.infer.loading import checkpoint_kind, load

    folder, _ = teacher
    assert checkpoint_kind(folder) == "llava_lora" and checkpoint_kind(release[2]) == "hf"
    merged = load_checkpoint(release[2], adapter=folder)
    config = load_config("configs/tiny.py")
    config.init.adapter = folder  # no hf_checkpoint: the base adapter_config.json names
    config.data.template = "llama3"
    loaded = load(config, folder)
    assert loaded.chat.image_token_id == VOCAB and "merged into" in loaded.description
    on_base = load(config, release[2]).model  # the base as the checkpoint, config.init.adapter merged into it
    for model in (build_model(config), loaded.model, on_base):
        for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(merged, nnx.Param)),
                                     nnx.to_flat_state(nnx.state(model, nnx.Param))):
            np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]), err_msg=str(path))


def test_lora_folder_whose_base_is_absent(teacher, tmp_path, capsys):
    folder = str(tmp_path / "orphan")
    shutil.copytree(teacher[0], folder)
    config = json.load(open(os.path.join(folder, "adapter_config.json")))
    json.dump(dict(config, base_model_name_or_path="/no/such/base"), open(os.path.join(folder, "adapter_config.json"), "w"))
    err = _tool_error(capsys, ["--model", folder] + _inputs(tmp_path))
    assert os.path.join(folder, "adapter_config.json") in err and "'base_model_name_or_path'" in err
    assert "/no/such/base" in err


# --------------------------------------------------------------------------- writing the format back

def _same_weights(a, b, atol=0.0):
    from flax import nnx

    left, right = nnx.to_flat_state(nnx.state(a, nnx.Param)), nnx.to_flat_state(nnx.state(b, nnx.Param))
    assert [p for p, _ in left] == [p for p, _ in right]
    for (path, x), (_, y) in zip(left, right):
        np.testing.assert_allclose(np.asarray(x[...]), np.asarray(y[...]), rtol=0, atol=atol, err_msg=str(path))


def test_export_then_import_is_exact(model, tmp_path):
    out = str(tmp_path / "export")
    llava.save_llava_checkpoint(model, out, max_shard_bytes=40_000)  # several shards
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["model_type"] == "llava_llama" and config["mm_patch_merge_type"] == "spatial_unpad"
    assert config["mm_vision_tower"] == os.path.join(out, "vision_tower")  # the tiny tower as a CLIP folder
    assert os.path.exists(os.path.join(out, "model.safetensors.index.json"))
    again = load_checkpoint(out)
    assert again.cfg == model.cfg
    _same_weights(model, again)


def test_exported_folder_loads_in_transformers_after_the_llava_hf_mapping(release, model, tmp_path):
    """The documented mapping (llava.KEY_PREFIXES) plus the row llava-hf appends for <image> gives transformers'
    LlavaNext back, with fire_jax's logits."""
    from safetensors.numpy import save_file
    from transformers import LlavaNextForConditionalGeneration

    out = str(tmp_path / "export")
    llava.save_llava_checkpoint(model, out)
    exported = dict(llava.iter_weights(out))
    assert "model.mm_projector.0.weight" in exported and "model.vision_tower.vision_tower.vision_model." \
        "embeddings.patch_embedding.weight" in exported
    hub_state = {llava.to_hub(k): v for k, v in exported.items()}
    for key in ("language_model.model.embed_tokens.weight", "language_model.lm_head.weight"):
        hub_state[key] = np.concatenate([hub_state[key], np.zeros_like(hub_state[key][:1])])  # <image>'s row
    folder = str(tmp_path / "llava_hf")
    os.makedirs(folder)
    save_file(hub_state, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    release[0].config.save_pretrained(folder)
    theirs = LlavaNextForConditionalGeneration.from_pretrained(folder).eval()
    errors = _logit_errors(model, theirs)
    print("exported folder in transformers, relative logit errors:", errors)
    assert max(errors) < 1e-5, errors


def test_lora_export_merges_back_to_the_same_model(release, tmp_path):
    import jax

    from fire_jax.models import merge_lora
    from fire_jax.models.config import LoraConfig

    model = load_checkpoint(release[2], lora=LoraConfig(rank=4, alpha=8.0, targets=("q", "k", "v")))
    keys = iter(jax.random.split(jax.random.key(3), 64))
    for layer in model.language_model.model.layers:
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            proj.lora_b[...] = 0.2 * jax.random.normal(next(keys), proj.lora_b[...].shape)
    linear = model.multi_modal_projector.linear_2  # a trained connector
    linear.bias[...] = jax.random.normal(next(keys), linear.bias[...].shape)
    out = str(tmp_path / "lora")
    llava.save_llava_lora(model, out, base=release[2])
    assert sorted(os.listdir(out)) == ["adapter_config.json", "adapter_model.safetensors", "config.json",
                                       "non_lora_trainables.bin", "vision_tower"]
    again = load_checkpoint(out, lora=None)  # the folder alone: on the base it names
    _same_weights(merge_lora(model), again, atol=1e-6)


def test_export_tool_writes_the_config_s_model(release, tmp_path):
    """tools/export_llava.py on a config's model (here its init: the original-format checkpoint)."""
    out = str(tmp_path / "exported")
    lines = []
    load_tool("export_llava").main(["--config", "configs/tiny.py", "--out", out,
                                    f"--config.init.hf_checkpoint={release[2]}"], print_fn=lines.append)
    assert "original LLaVA format" in lines[-1]
    _same_weights(load_checkpoint(release[2], lora=None), load_checkpoint(out, lora=None))


def test_fire_recipes_on_the_release_s_base():
    from fire_jax.core.config import load_config

    for recipe, template in (("fire_student", "llama_v3_student"), ("fire_teacher", "llama_v3_teacher")):
        config = load_config(f"configs/fire.py:{recipe},base=open_llava_next_8b,released=True")
        assert config.data.template == template and config.init.hf_checkpoint == "/data/open-llava-next-llama3-8b"
        assert config.model.llm.vocab_size == config.model.image_token_id == 128256  # <image>: the next free id
        assert config.data.tokenizer == "/data/open-llava-next-llama3-8b/tokenizer.json"
        assert tuple(config.model.lora.targets) == ("q", "k", "v") and config.train.train_connector


def test_batch_infer_takes_the_lora_folder_alone(release, teacher, tmp_path):
    """A command line that accepts a checkpoint takes the release's teacher folder as it is shipped."""
    from PIL import Image

    from fire_jax import batch_infer

    Image.new("RGB", (70, 40), "red").save(tmp_path / "red.png")
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text(json.dumps(dict(id="p0", image="red.png", question="What color?", groundtruth="red",
                                      answer="Answer: blue")) + "\n")
    out = []
    summary = batch_infer.main(["--checkpoint", teacher[0], "--role", "teacher", "--input", str(source),
                                "--output", str(output), "--image_root", str(tmp_path), "--max_new_tokens", "4",
                                "--config.data.template=llama_v3_teacher"], print_fn=out.append)
    assert summary["written"] == 1 and "merged into" in "\n".join(out)
    first = json.loads(output.read_text())
    assert first["id"] == "p0"
    again, seen = tmp_path / "again.jsonl", len(out)  # --checkpoint BASE --adapter LORA: the same teacher
    batch_infer.main(["--checkpoint", release[2], "--adapter", teacher[0], "--role", "teacher", "--input",
                      str(source), "--output", str(again), "--image_root", str(tmp_path), "--max_new_tokens", "4",
                      "--config.data.template=llama_v3_teacher"], print_fn=out.append)
    assert any("+ LLaVA LoRA" in line for line in out[seen:]) and json.loads(again.read_text()) == first


def test_linear_connector(release, tmp_path):
    """mm_projector_type "linear" (one nn.Linear, keys model.mm_projector.*): image features are the tower's
    layer -2 patches through that Linear alone, against transformers' CLIP; export and import are exact."""
    hf = release[0]
    state = original_state(hf)
    state["model.mm_projector.weight"] = state.pop("model.mm_projector.0.weight")[:, :]
    state["model.mm_projector.bias"] = state.pop("model.mm_projector.0.bias")
    del state["model.mm_projector.2.weight"], state["model.mm_projector.2.bias"]
    config = original_config(hf, release[1], mm_projector_type="linear")
    model = load_checkpoint(write_original(str(tmp_path / "linear"), state, config))
    assert model.cfg.projector == "linear" and model.multi_modal_projector.linear_2 is None
    pixels = np.random.default_rng(0).standard_normal((1, 2, 3, 32, 32)).astype(np.float32)
    ours = np.asarray(model.image_features(jnp.asarray(pixels)))[0]
    with torch.no_grad():
        hidden = hf.model.vision_tower(torch.as_tensor(pixels[0]), output_hidden_states=True).hidden_states[-2]
        ref = (hidden[:, 1:] @ torch.as_tensor(state["model.mm_projector.weight"]).T
               + torch.as_tensor(state["model.mm_projector.bias"])).numpy()
    assert rel_err(ours, ref) < 1e-5
    out = str(tmp_path / "export")
    llava.save_llava_checkpoint(model, out)
    assert "model.mm_projector.weight" in dict(llava.iter_weights(out))
    assert json.load(open(os.path.join(out, "config.json")))["mm_projector_type"] == "linear"
    _same_weights(model, load_checkpoint(out))
