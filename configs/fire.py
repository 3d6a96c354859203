# FIRE training recipes at 8B (SPEC section 4). Each named config file calls this one; sweeps pass options:
#   python -m fire_jax.train --config configs/fire.py:fire_student,released=True --workdir DIR
#   python -m fire_jax.train --config configs/fire.py:fire_student,fire_1m=200000 --workdir DIR   (Fig. 6 ablation)
"""FIRE100K-LLaVA, FIRE-LLaVA and FD-LLaVA on LLaVA-NeXT-8B.

arg: ``<recipe>[,key=value...]`` with recipe one of fire100k_student, fire_student, fire_teacher and keys
  data_dir  where tools/build_dataset.py wrote the FIRE TFDS splits (default /data/fire_tfds)
  llava     the LLaVA-665K-style instruction JSON to mix in (default /data/llava/llava_v1_5_mix665k.json)
  images    image root of that JSON (default /data/llava/images)
  tokenizer the Llama-3 tokenizer.json (default /data/llama3-llava-next-8b-hf/tokenizer.json)
  hf        the llava-hf checkpoint to start from (default /data/llama3-llava-next-8b-hf)
  fire_1m   how many FIRE-1M examples the student sees (fire_student: 1000000; the ablation: 200000..1000000)
  llava_n   how many instruction examples to mix in (default 0: SPEC leaves the ratio to the run; set it)
  released  True: LoRA on q,k,v and the connector trained, as the released checkpoints were
"""

import os

from fire_jax.data.config import load_config
from fire_jax.train.defaults import loss_config, mesh_config, train_config

RECIPES = ("fire100k_student", "fire_student", "fire_teacher")
SIZES = {"fire_100k": 100_000, "fire_1m": 1_000_000}  # FIRE paper, dataset sizes


def parse_arg(arg: str) -> tuple[str, dict]:
    recipe, *pairs = [p for p in arg.split(",") if p]
    if recipe not in RECIPES:
        raise ValueError(f"configs/fire.py: recipe {recipe!r} unknown; choose from {RECIPES}")
    options = dict(data_dir="/data/fire_tfds", llava="/data/llava/llava_v1_5_mix665k.json",
                   images="/data/llava/images", tokenizer="/data/llama3-llava-next-8b-hf/tokenizer.json",
                   hf="/data/llama3-llava-next-8b-hf", fire_1m=SIZES["fire_1m"], llava_n=0, released=False)
    for pair in pairs:
        key, _, value = pair.partition("=")
        if key not in options:
            raise ValueError(f"configs/fire.py: option {key!r} unknown; known: {sorted(options)}")
        kind = type(options[key])
        options[key] = (value.lower() in ("1", "true", "yes")) if kind is bool else kind(value)
    return recipe, options


def get_config(arg: str = "fire_student"):
    recipe, o = parse_arg(arg)
    config = load_config(os.path.join(os.path.dirname(os.path.abspath(__file__)), "llava_next_8b.py"))
    config.init = dict(hf_checkpoint=o["hf"])
    if o["released"]:
        config.model.lora.targets = ("q", "k", "v")
    role = "teacher" if recipe == "fire_teacher" else "student"
    sources = {"fire_100k": dict(tfds=o["data_dir"], split="fire_100k", num_examples=SIZES["fire_100k"])}
    if recipe == "fire_student":
        sources["fire_1m"] = dict(tfds=o["data_dir"], split="fire_1m", num_examples=o["fire_1m"],
                                  max_examples=o["fire_1m"])
    if o["llava_n"]:
        sources["llava_665k"] = dict(json=o["llava"], image_root=o["images"], num_examples=o["llava_n"],
                                     max_examples=o["llava_n"])
    config.data = dict(
        tokenizer=o["tokenizer"], image_token="<image>", pad_token="<pad>", role=role,
        student_first_turn=False, teacher_history="full", sources=sources,
        eval_sources={"fire_bench": dict(tfds=o["data_dir"], split="fire_bench")},
        on_bad_record="skip", max_len=3072, buckets=(1024, 2048, 3072), batch_size=64, shuffle=True, seed=0,
        num_epochs=1, num_threads=16, num_workers=8)
    config.train = train_config(train_connector=o["released"], accum_steps=8, checkpoint_every=200)  # 1 example per device per micro-batch on 8 GPUs
    config.loss = loss_config()
    config.mesh = mesh_config((1, -1, 1))  # FSDP over all devices; set (data, fsdp, tensor) per cluster
    return config
