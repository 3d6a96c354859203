"""A model and its chat tokenizer for inference, from a config and an optional checkpoint (the backends of
:func:`fire_jax.infer.factory.generator` and the server build on it).

A checkpoint is one of (detected from the files in the directory):

- ``hf``: a Hugging Face LLaVA-NeXT directory (config.json + safetensors), or one of the original LLaVA
  format (``LlavaLlamaForCausalLM``: safetensors or torch ``.bin``); its
  ``tokenizer.json`` is used when present, else ``config.data.tokenizer``; LoRA fresh.
- ``peft``: a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors,
  what :func:`fire_jax.convert.hf.save_peft_adapter` and the trainer's export write).
  The base model is ``config.init.hf_checkpoint``, else the adapter's
  ``base_model_name_or_path`` when that is a local HF directory, else the
  config's random initialisation (the tiny models the tests train on).
- ``llava_lora``: a LoRA folder of the original LLaVA format (the FIRE release's teacher: adapter_config.json,
  adapter weights, ``non_lora_trainables.bin``), merged into its base as the release's builder does
  (:mod:`fire_jax.convert.llava`). The base is ``config.init.hf_checkpoint``, else the folder's
  ``base_model_name_or_path`` when that is a local folder; the base's ``tokenizer.json`` is used when present.
- ``workdir``: a ``fire_jax.train`` workdir (config.json + checkpoints/); the
  model is rebuilt from the run's own config.json and its trainable parameters
  (LoRA, and the connector if it was trained) come from the latest (or the
  given) orbax checkpoint.

No checkpoint: the config's model (random weights, or ``config.init.hf_checkpoint``).
"""

from __future__ import annotations

import copy
import dataclasses
import glob
import os

from fire_jax.weights.build import build_model
from fire_jax.weights.checkpoint import restore_params
from fire_jax.core.config import resolve_path
from fire_jax.convert.hf import load_peft_adapter, peft_lora_config
from fire_jax.convert.llava import adapter_base, is_llava_lora
from fire_jax.data.chat import ChatTokenizer
from fire_jax.core.results import read_json, read_json_object

CHECKPOINT_KINDS = ("hf", "peft", "llava_lora", "workdir")


@dataclasses.dataclass
class Loaded:
    """A model ready to generate, the chat tokenizer that matches it, and where it came from."""

    model: object  # fire_jax.models.LlavaNext
    chat: ChatTokenizer
    config: object  # the ConfigDict it was built from (a train workdir's own config.json)
    description: str


def display_name(*, name: str = "", checkpoint: str = "", init: str = "", fallback: str = "random init") -> str:
    """What a model is called in tables and logs: ``name``; else an endpoint's "model (base_url)"; else the
    checkpoint's training run (``RUN/export/peft_adapter`` -> ``RUN``) or folder; else the init checkpoint's
    folder; else ``fallback``."""
    from fire_jax.infer.api import is_api_spec, parse_spec

    if name:
        return name
    for path in (checkpoint, init):
        if is_api_spec(path):
            base_url, model = parse_spec(path)
            return f"{model} ({base_url})"
        if path:
            path = os.path.normpath(path)
            if path.endswith(os.path.join("export", "peft_adapter")):  # a training workdir's export: its run
                path = os.path.dirname(os.path.dirname(path))
            return os.path.basename(path)
    return fallback


def checkpoint_kind(path: str) -> str:
    """One of :data:`CHECKPOINT_KINDS` for a checkpoint directory; raises naming what each kind needs."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint {path!r}: no such directory")
    has = lambda *names: all(os.path.exists(os.path.join(path, n)) for n in names)
    if is_llava_lora(path):
        return "llava_lora"
    if has("adapter_config.json", "adapter_model.safetensors"):
        return "peft"
    if has("config.json") and os.path.isdir(os.path.join(path, "checkpoints")):
        return "workdir"
    if has("config.json") and (glob.glob(os.path.join(path, "*.safetensors")) or
                               glob.glob(os.path.join(path, "pytorch_model*.bin"))):
        return "hf"
    raise ValueError(
        f"checkpoint {path!r} is none of: a Hugging Face checkpoint, llava-hf's or the original LLaVA format's "
        f"(config.json + *.safetensors or pytorch_model*.bin), a PEFT adapter (adapter_config.json + adapter_model.safetensors), a LLaVA LoRA "
        f"folder (adapter_config.json + non_lora_trainables.bin), a fire_jax train workdir (config.json + "
        f"checkpoints/); "
        f"it holds {sorted(os.listdir(path))[:10]}")


def check_checkpoint_arg(parser, value: str | None, flag: str) -> None:
    """Fail a command line early (``parser.error``, exit 2) when ``value`` is not a loadable checkpoint."""
    if value is not None:
        try:
            checkpoint_kind(resolve_path(value))
        except (FileNotFoundError, ValueError) as e:
            parser.error(f"{flag}: {e}")


def load(config, checkpoint: str | None = None, *, step: int | None = None) -> Loaded:
    """The model of ``config``, or of a checkpoint directory of any kind in :data:`CHECKPOINT_KINDS`.

    ``step`` picks a train workdir's checkpoint (default: the latest).
    """
    if checkpoint is None:
        return _loaded(build_model(config), config, _base(config))
    checkpoint = resolve_path(checkpoint)
    kind = checkpoint_kind(checkpoint)
    if kind == "hf":
        config = copy.deepcopy(config)
        adapter = config.init.get("adapter") if config.get("init") else None  # a LoRA folder to merge into it
        config.init = dict(hf_checkpoint=checkpoint, adapter=adapter or "")
        tokenizer = os.path.join(checkpoint, "tokenizer.json")
        merged = f" + LLaVA LoRA {adapter} merged" if adapter else ""
        return _loaded(build_model(config), config, f"HF checkpoint {checkpoint}{merged}",
                       tokenizer if os.path.exists(tokenizer) else None)
    if kind == "peft":
        config = copy.deepcopy(config)
        config.model.lora = peft_lora_config(checkpoint)
        if not (config.get("init") and config.init.get("hf_checkpoint")):
            named = read_json_object(os.path.join(checkpoint, "adapter_config.json")).get(
                "base_model_name_or_path") or ""
            if named and os.path.exists(os.path.join(named, "config.json")):
                config.init = dict(hf_checkpoint=named)
        model = load_peft_adapter(build_model(config), checkpoint)
        return _loaded(model, config, f"PEFT adapter {checkpoint} on {_base(config)}")
    if kind == "llava_lora":
        config = copy.deepcopy(config)
        base = (config.init.get("hf_checkpoint") if config.get("init") else None) or adapter_base(checkpoint)
        config.init = dict(hf_checkpoint=base, adapter=checkpoint)
        tokenizer = os.path.join(base, "tokenizer.json")
        return _loaded(build_model(config), config, f"LLaVA LoRA {checkpoint} merged into {base}",
                       tokenizer if os.path.exists(tokenizer) else None)
    config = workdir_config(checkpoint)
    model = build_model(config)
    restored = restore_params(model, checkpoint, config.train, step=step)
    return _loaded(model, config, f"train workdir {checkpoint}, step {restored}")


def _base(config) -> str:
    """What :func:`fire_jax.weights.build.build_model` builds the weights from, in words."""
    source = config.init.get("hf_checkpoint") if config.get("init") else None
    return f"HF checkpoint {source}" if source else f"random init (seed {config.seed})"


def _loaded(model, config, description: str, tokenizer: str | None = None) -> Loaded:
    from fire_jax.models import set_layer_layout

    # Generation reads each layer's weights in place from the per-layer list; a weight sliced out of a stack
    # (scan_layers=True, how the 8B configs train) is a copy per decode step on XLA:CPU. Same weights, converted
    # in place after any checkpoint restore (which needs the layout it was trained with).
    if model.cfg.scan_layers:
        set_layer_layout(model, False)
    data = config.data
    chat = ChatTokenizer.from_file(tokenizer or resolve_path(data.tokenizer), model.cfg.geometry,
                                   template=data.get("template") or None,
                                   image_token=data.get("image_token", "<image>"),
                                   pad_token=data.get("pad_token", "<pad>"),
                                   input_cut=model.cfg.max_input_tokens)
    return Loaded(model, chat, config, description)


def workdir_config(workdir: str):
    """The resolved config a train run wrote to ``workdir/config.json``."""
    import ml_collections

    return ml_collections.ConfigDict(read_json(os.path.join(workdir, "config.json")))
