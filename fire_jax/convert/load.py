"""A model from a file of any format the project reads: a LLaVA checkpoint folder (llava-hf's, or the original LLaVA
format's, the FIRE release's, with its LoRA folders merged in as the release's ``llava/model/builder.py`` merges
them), or a GGUF file's LLM. The formats' own readers (:mod:`fire_jax.convert.hf`, :mod:`fire_jax.convert.llava`,
:mod:`fire_jax.convert.gguf`) know nothing of each other; this module tells them apart.
"""

from __future__ import annotations

import os
from typing import Any, Callable

from fire_jax.core.config import InputError
from fire_jax.convert import llava
from fire_jax.convert.gguf import TEXT_ONLY_VISION, llava_from_gguf
from fire_jax.convert.hf import load_hf_checkpoint, read_config
from fire_jax.models.config import LoraConfig
from fire_jax.models.llava_next import LlavaNext


def load_checkpoint(directory: str, lora: LoraConfig | None = LoraConfig(), *, seed: int = 0,
                    sharding: Callable[[str, Any], Any] | None = None, adapter: str | None = None,
                    **overrides) -> LlavaNext:
    """A LLaVA checkpoint folder of either format into a fresh NNX model: llava-hf's
    (:func:`fire_jax.convert.hf.load_hf_checkpoint`), or the original LLaVA format's (``model_type``
    "llava_llama": :func:`fire_jax.convert.llava.load_llava_checkpoint`), with ``adapter`` a LoRA folder of that
    format merged into it; a LoRA folder given as ``directory`` goes on the base its ``adapter_config.json``
    names. ``lora``, ``seed``, ``sharding`` and ``overrides`` as :func:`fire_jax.convert.hf.load_hf_checkpoint`.
    """
    if adapter is None and llava.is_llava_lora(directory):
        directory, adapter = llava.adapter_base(directory), directory
    if adapter or llava.is_llava_config(read_config(directory)):
        return llava.load_llava_checkpoint(directory, lora, seed=seed, sharding=sharding, adapter=adapter,
                                           **overrides)
    return load_hf_checkpoint(directory, lora, seed=seed, sharding=sharding, **overrides)


def load_model(path: str, adapter: str | None = None, **overrides) -> LlavaNext:
    """A model without LoRA from a LLaVA checkpoint folder (:func:`load_checkpoint`, ``adapter`` merged in), or
    from a ``.gguf`` file: its LLM under :data:`fire_jax.convert.gguf.TEXT_ONLY_VISION` (text-only inputs).
    ``overrides`` set LlavaNextConfig fields."""
    if os.fspath(path).endswith(".gguf"):
        if adapter:
            raise InputError(f"{path}: an adapter merges into a LLaVA checkpoint folder, not a .gguf file")
        return llava_from_gguf(path, TEXT_ONLY_VISION, None, **overrides)
    return load_checkpoint(path, lora=None, adapter=adapter, **overrides)
