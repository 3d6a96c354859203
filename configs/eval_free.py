# FIRE-Bench free dialogues (FIRE Tables 4-6, Fig. 7). Tiny random models on the synthetic test set (CPU):
#   python -m fire_jax.evaluate --config configs/eval_free.py --workdir /tmp/fire_free
# The baseline first (LLaVA-NeXT-8B as student, FD-LLaVA as teacher), then FIRE-LLaVA with AT normalised by it:
#   python -m fire_jax.evaluate --config configs/eval_free.py:8b --workdir BASE --config.teacher.adapter=FD_LLAVA
#   python -m fire_jax.evaluate --config configs/eval_free.py:8b --workdir OUT --config.teacher.adapter=FD_LLAVA \
#     --config.student.adapter=FIRE_LLAVA --config.free.baseline_results=BASE/results.json
"""Free dialogues: configs/eval_fixed.py's models, data and decoding, with the free-dialogue protocol.

arg: as configs/eval_fixed.py ("" / "tiny" or "8b", ",release=True"). With release=True, as the release's
model_fire_chat_loader.py runs its free dialogues: 160 new tokens, images in "pad" mode (one 336 tile, 576
features, no image_newline: it sets image_aspect_ratio="pad" on the model), its score reading (a reply it cannot
read scores 0 and stops the dialogue).
"""

import os

import ml_collections

from fire_jax.core.config import FREE_DIALOGUE_NEW_TOKENS, load_config, parse_arg

CONFIGS = os.path.dirname(os.path.abspath(__file__))


def get_config(arg: str = "") -> ml_collections.ConfigDict:
    config = load_config(os.path.join(CONFIGS, "eval_fixed.py") + (f":{arg}" if arg else ""))
    config.setting = "free"
    del config["fixed"]
    size, options = parse_arg(arg, where="configs/eval_free.py", names=("tiny", "8b"), release=False)
    release = options["release"]
    config.decode.max_new_tokens = 16 if size == "tiny" and not release else FREE_DIALOGUE_NEW_TOKENS
    config.free = ml_collections.ConfigDict(dict(
        # The stop rule (fire_jax.dialogue.stop.StopRule, every field of it): max_turns, threshold,
        # stop_on_no_increase, score_parser. The release's interactive chat (llava/eval/feedback_chat.py) stops only
        # at a score of 10 within 3 rounds: max_turns=3, threshold=10.0, stop_on_no_increase=False.
        max_turns=5,  # n_max
        threshold=8.0,  # a score >= threshold solves the item
        stop_on_no_increase=True,  # stop when a score is not above the one before
        penalty_turns=10.0,  # p: t_k of an unsolved dialogue
        teacher_history="latest",  # the teacher sees only the latest answer (Fig. A14)
        baseline_results="",  # results.json of the baseline's free run: AT = mean t_k / its mean t_k ("" = self)
        # How the teacher's scores are read: "robust", or "official" (the release's get_score: "Score: 7.5" is 7,
        # no range check; a score of 0 stops the dialogue, as its model_fire_chat_loader.py).
        score_parser="robust",
    ))
    if release:
        config.model.image_mode, config.model.pad_newline = "pad", False
        config.free.score_parser = "official"
    return config
