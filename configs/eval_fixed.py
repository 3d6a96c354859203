# FIRE-Bench fixed dialogues (FIRE Tables 2-3). Tiny random models on the shipped synthetic test set (CPU, seconds):
#   python -m fire_jax.evaluate --config configs/eval_fixed.py --workdir /tmp/fire_fixed
# LLaVA-NeXT-8B, the student FIRE-LLaVA and the teacher FD-LLaVA as trained adapters:
#   python -m fire_jax.evaluate --config configs/eval_fixed.py:8b --workdir DIR \
#     --config.student.adapter=FIRE_LLAVA_WORKDIR --config.teacher.adapter=FD_LLAVA_WORKDIR/export/peft_adapter
"""Evaluation config shared by both FIRE-Bench settings; configs/eval_free.py starts from it.

arg: "" / "tiny" (configs/tiny.py's model and tokenizer, random weights, assets:synthetic_fire/test.json) or "8b"
(configs/llava_next_8b.py, weights from the llava-hf checkpoint, the released FIRE-test.json); ",release=True": the
release's own settings for evaluating its models (MM-FIRE/FIRE ``llava/eval/``, docs/reproducing.md): its
templates (``llama_v3_student``), 512 new tokens in fixed dialogues (``eval_feedback.py`` generates with
``feedback_chat.py``'s 512), its score reading (``get_score``), the student's first turn generated too (its
``eval_feedback.py`` generates every gpt turn), its teacher prompt (``fixed.teacher_prompt="release"``: the record's
turns as they are, no instruction message). The models' input conventions (pinpoints, BOS, alpha, the prompt
cut) come with their checkpoints: an original-format folder runs as the release runs it
(``config.model.conventions`` overrides: "transformers" or "release").
"""

import os

import ml_collections

from fire_jax.core.config import load_config, parse_arg

CONFIGS = os.path.dirname(os.path.abspath(__file__))
LLAVA_NEXT_8B = "/data/llama3-llava-next-8b-hf"  # the llava-hf checkpoint: config.json, safetensors, tokenizer.json
FIRE_DATA = "/data/fire"  # FIRE-test.json and images/ of the release


def get_config(arg: str = "") -> ml_collections.ConfigDict:
    size, options = parse_arg(arg, where="configs/eval_fixed.py", names=("tiny", "8b"), release=False)
    tiny = size == "tiny"
    base = load_config(os.path.join(CONFIGS, "tiny.py" if tiny else "llava_next_8b.py"))
    config = ml_collections.ConfigDict()
    config.setting = "fixed"
    config.seed = 0  # random weights (tiny) and sampling
    config.model = base.model  # both agents' architecture; LoRA r/alpha/targets come from an adapter
    config.model.remat = "none"  # inference: nothing to rematerialise
    config.model.conventions = ""  # "": each checkpoint's (fire_jax.core.geometry.CONVENTIONS); or force one
    config.release = options["release"]
    # --config.model.image_mode=pad: one 336 tile per image, as the official free-dialogue evaluation.
    if tiny:
        config.data = dict(tokenizer=base.data.tokenizer, image_token="<image>", pad_token="<pad>", template="")
        config.test = dict(json="assets:synthetic_fire/test.json", image_root="assets:synthetic_fire/images")
    else:
        config.data = dict(tokenizer=f"{LLAVA_NEXT_8B}/tokenizer.json", image_token="<image>", pad_token="<pad>",
                           template="")  # "" = the tokenizer's tokenizer_config.json, else llama3; or a shipped name
        config.test = dict(json=f"{FIRE_DATA}/FIRE-test.json", image_root=f"{FIRE_DATA}/images")
    config.test.max_examples = 0  # > 0: a fixed random subset of that many conversations
    config.on_bad_record = "skip"  # or "error"
    # The exact judge (answer after "Answer:" == groundtruth, fire_jax/eval/judge.py): "auto" = on for synthetic
    # test sets (every source "synthetic_*"), whose groundtruth is the exact answer sentence; True / False force it.
    config.exact_judge = "auto"
    # init: a llava-hf LLaVA-NeXT folder, "" = random weights of config.model. adapter: "" (none), a PEFT adapter
    # folder, or a training workdir (its latest checkpoint). name: our row in the tables ("" = the folder name).
    init = "" if tiny else LLAVA_NEXT_8B
    config.student = dict(name="", init=init, adapter="")
    config.teacher = dict(name="", init=init, adapter="")
    config.decode = dict(
        batch_size=4 if tiny else 16,
        max_new_tokens=16 if tiny else 128,  # 128 for fixed dialogues (the release: 512; docs/reproducing.md)
        temperature=0.0,  # 0: greedy
        top_k=0,
        top_p=1.0,
        bucket_min=64,  # prompt length buckets: powers of two from bucket_min to bucket_step, then multiples
        bucket_step=1024,
    )
    config.fixed = dict(
        roles=("student", "teacher"),
        student_first_turn=False,  # True: also generate r_1 (the turns the release's student loss labelled)
        teacher_history="full",  # the teacher sees every earlier turn, as trained (Eq. 6)
        # "paper": FIRE Eq. 6's teacher prompt (question and groundtruth, the instruction message, the answers);
        # "release": the record's turns as the release's eval_feedback.py feeds them (no instruction message;
        # fire_jax.data.chat.release_teacher_messages)
        teacher_prompt="paper",
        # Read when the metrics are computed (a rerun may change them). Teacher BLEU/CIDEr compare the
        # "feedback" after "Feedback:" ("" for a reply the release cannot read), as the release's
        # analyze_feedback.py, or the "whole" reply, score line included.
        teacher_text="feedback",
        # How the MAE reads scores: "robust", or "official" (the release's get_score; a reply without a
        # "Feedback:" has no score, as its eval_feedback.py reads it).
        score_parser="robust",
    )
    if options["release"]:  # the release's settings (docstring above)
        config.data.template = "llama_v3_student"  # = llama_v3_teacher (conversation.py: the same text)
        config.decode.max_new_tokens = 512
        config.fixed.score_parser = "official"
        config.fixed.student_first_turn = True
        config.fixed.teacher_prompt = "release"
    return ml_collections.ConfigDict(config)
