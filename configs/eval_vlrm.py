# VLRMBench with a fire_jax model (docs/vlrmbench.md). Dry run, tiny random model (CPU, seconds):
#   python -m fire_jax.evaluate_vlrm --config configs/eval_vlrm.py --data_dir DIR --workdir /tmp/vlrm_tiny
# LLaVA-NeXT-8B, or a FIRE model (a trained PEFT adapter on it), judged by the base model:
#   python -m fire_jax.evaluate_vlrm --config configs/eval_vlrm.py:8b --data_dir /data/vlrmbench \
#     --image_root /data/vlrmbench/images --workdir DIR \
#     --config.checkpoint=RUN/export/peft_adapter --config.judge.checkpoint=/data/llama3-llava-next-8b-hf
# The paper's analyses (Tables 4-7, Fig. 4) after the tasks they read:
#   python -m fire_jax.evaluate_vlrm --config configs/eval_vlrm.py:8b --data_dir /data/vlrmbench --workdir DIR \
#     --analyses=positional,voting,shots,length,correction --config.analyses.correction.data=/data/mathvista.jsonl \
#     --config.analyses.correction.image_root=/data/mathvista/images
"""Evaluation config: the model (tiny by default; arg "8b" for LLaVA-NeXT-8B), VLRMBench settings, decoding, judge.

arg: "" / "tiny" (configs/tiny.py's model and tokenizer, random weights) or "8b" (configs/llava_next_8b.py,
weights from init.hf_checkpoint). Override any field with --config.<field>=value; ``checkpoint`` evaluates a
trained model instead (a HF directory, a PEFT adapter on init.hf_checkpoint, or a fire_jax.train workdir).
"""

import os

import ml_collections

from fire_jax.core.config import load_config, parse_arg

CONFIGS = os.path.dirname(os.path.abspath(__file__))
LLAVA_NEXT_8B = "/data/llama3-llava-next-8b-hf"  # the llava-hf checkpoint: config.json, safetensors, tokenizer.json


def get_config(arg: str = "") -> ml_collections.ConfigDict:
    size, _ = parse_arg(arg, where="configs/eval_vlrm.py", names=("tiny", "8b"))
    base = load_config(os.path.join(CONFIGS, "tiny.py" if size == "tiny" else "llava_next_8b.py"))
    config = ml_collections.ConfigDict()
    config.name = ""  # our row in the table; "" = the checkpoint's run / folder name, or "random init"
    config.checkpoint = ""  # HF dir, PEFT adapter (e.g. RUN/export/peft_adapter) or train workdir; "" = init
    config.seed = 0
    config.model = base.model
    if size == "tiny":
        config.data = base.data  # only tokenizer, image_token and pad_token are read
        config.init = dict(hf_checkpoint="", adapter="")  # random weights
    else:
        config.model.remat = "none"  # inference: nothing to rematerialise
        config.data = dict(tokenizer=f"{LLAVA_NEXT_8B}/tokenizer.json", image_token="<image>", pad_token="<pad>")
        config.init = dict(hf_checkpoint=LLAVA_NEXT_8B, adapter="")  # also the base of a PEFT adapter checkpoint
    config.vlrm = dict(
        tasks="all",  # or "SC,IC,..." (short or file names); --tasks overrides
        parser="robust",  # or "official": the release's reading, for comparable numbers
        render="plain",  # or "official": step_list as str(list) in MJ / FF, as the release
        # How results.json's "scores" and the W-Avgs count failed samples: "ours" counts a sample without an
        # output or not fully read wrong; "official" scores as the release's scorers (a short or unread answer
        # padded and scored, a sample without an output left out); "vlmevalkit" as VLMEvalKit's scorer (a sample
        # without an output scored as its failure message; no ERA/EC). All are always in the table and by_accounting.
        accounting="ours",
        # A record whose image file does not exist: "skip" (a bad record, counted), "send_without" (its request
        # goes without the image and is scored, as the release's clients do), "auto": send_without under
        # accounting="official", else skip.
        missing_images="auto",
        on_bad_record="skip",  # or "error"
    )
    config.generate = dict(
        batch_size=4 if size == "tiny" else 8,
        max_new_tokens=16 if size == "tiny" else 1024,  # the model's answer / ERA-EC critique
        # Tile axis of every batch (a sample's images' tiles concatenated); a sample needing more stops the run.
        # 0: the batch's largest sample, rounded up to a multiple of one image's most tiles (IC has 1-3 images).
        max_tiles=0,
        bucket_min=64,  # prompt length buckets (powers of two from bucket_min to bucket_step, then multiples)
        bucket_step=1024,
    )
    synthetic = os.path.join(os.path.dirname(CONFIGS), "fire_jax", "assets", "synthetic_fire")
    # The paper's analyses (--analyses=positional,voting,shots,length,correction; fire_jax/vlrmbench/analyses.py).
    config.analyses = dict(
        shots=dict(k="0,1,2"),  # SC with k in-context examples (Table 6); 0-shot is the main run
        voting=dict(tasks="SC", k="1,3,5", temperature=0.9),  # majority of the first k of max(k) samples (Fig. 4)
        correction=dict(  # Table 7: a student answers, this model writes the ERA analysis, the student retries
            # (I, q, gt) items: FIRE records or {"image", "question", "groundtruth", "source"} (JSON / JSONL)
            data=os.path.join(synthetic, "test.json") if size == "tiny" else "",
            image_root=os.path.join(synthetic, "images") if size == "tiny" else "",
            max_examples=0,  # 0: all items; else a fixed random subset
            student_config="",  # the student's config file; "" = this config (the evaluated model's)
            student_checkpoint="",  # its weights; "" = that config's checkpoint
            max_new_tokens=16 if size == "tiny" else 512,  # the student's answers and the ERA analyses
        ),
    )
    config.judge = dict(
        name="",  # shown in the table; "" = derived from the judge's model
        # Both "": the evaluated model judges its own critiques against the reference.
        config="",  # a config file (e.g. "configs/eval_vlrm.py:8b") for the judge; "" = the evaluated model's
        checkpoint="",  # the judge's weights (any kind `checkpoint` takes); "" = that config's
        max_new_tokens=16 if size == "tiny" else 256,  # the judge's two scores
    )
    return ml_collections.ConfigDict(config)
