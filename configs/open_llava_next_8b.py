# Open-LLaVA-NeXT-8B (Lin-Chen/open-llava-next-llama3-8b), the base the FIRE release trained both its models from,
# in the original LLaVA format (fire_jax/convert/llava.py). Model sizes only: configs/fire.py builds on it, e.g.
#   python -m fire_jax.train --config configs/fire.py:fire_student,base=open_llava_next_8b --workdir DIR
"""Open-LLaVA-NeXT-8B: LLaVA-NeXT-8B's shapes with the original checkpoint's vocabulary (no <image> row)."""

import os

from fire_jax.core.config import load_config


def get_config(arg: str = ""):
    del arg
    config = load_config(os.path.join(os.path.dirname(os.path.abspath(__file__)), "llava_next_8b.py"))
    # The checkpoint's 128256 Llama-3 tokens; <image> takes the next free id, outside the embedding and the
    # logits (the release splices image features where its prompts hold -200).
    config.model.llm.vocab_size = 128256
    config.model.image_token_id = 128256
    return config
