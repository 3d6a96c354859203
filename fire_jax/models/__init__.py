"""Models: ``LlavaNext`` (CLIP + connector + Llama-3 with LoRA) and its typed config."""

from fire_jax.models.config import LlamaConfig, LlavaNextConfig, LoraConfig, VisionConfig
from fire_jax.models.layers import InitKeys, LoRAParam
from fire_jax.models.llama import KVCache
from fire_jax.models.llava_next import LlavaNext, count_params, fold_lora, merge_lora, set_attention, set_layer_layout, set_remat

Model = LlavaNext

__all__ = ["Model", "LlavaNext", "LlavaNextConfig", "VisionConfig", "LlamaConfig", "LoraConfig", "LoRAParam",
           "InitKeys", "KVCache", "fold_lora", "merge_lora", "set_layer_layout", "set_attention", "set_remat", "count_params"]
