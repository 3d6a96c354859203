# FIRE training recipes at 8B (FIRE Sec. 5.1). Each named config file calls this one; sweeps pass options:
#   python -m fire_jax.train --config configs/fire.py:fire_student --workdir DIR
#   python -m fire_jax.train --config configs/fire.py:fire_student,released=True --workdir DIR
#   python -m fire_jax.train --config configs/fire.py:fire_student,fire_1m=200000 --workdir DIR   (Fig. 6 ablation)
#   python -m fire_jax.train --config configs/fire.py:fire_teacher,llava_n=100000 --workdir DIR   (less LLaVA-665K)
#   python -m fire_jax.train --config configs/fire.py:fire_student,base=llava_15_vicuna_7b --workdir DIR   (Table A6)
#   python -m fire_jax.train --config configs/fire.py:fire_student,base=open_llava_next_8b,released=True --workdir DIR
"""FIRE100K-LLaVA, FIRE-LLaVA and FD-LLaVA on LLaVA-NeXT-8B, or on the appendix's Vicuna-7B bases.

The paper (Sec. 5.1, Training Data) trains every model on its FIRE data *combined with LLaVA-665K* "to avoid
catastrophic forgetting", for the student and for the teacher: so does every recipe here by default (source
``llava_665k``, all of it). ``llava_n`` / ``llava_ratio`` set how much; ``llava_n=0`` trains on FIRE alone.

arg: ``<recipe>[,key=value...]`` with recipe one of fire100k_student, fire_student, fire_teacher and keys
  data_dir     where tools/build_dataset.py wrote the TFDS splits (default /data/fire_tfds): fire_100k, fire_1m,
               and instruct (LLaVA-665K: ``--json llava_v1_5_mix665k.json --split instruct``)
  llava        a LLaVA-665K-style JSON to read instead of the built ``instruct`` split ("" = the split)
  images       image root of that JSON (default /data/llava/images)
  llava_n      instruction examples mixed in: -1 (default) all of LLaVA-665K, 0 none, N a fixed random N
  llava_ratio  instead of llava_n: instruction examples per FIRE example (0.5: half as many as FIRE's)
  tokenizer    the Llama-3 tokenizer.json (default /data/llama3-llava-next-8b-hf/tokenizer.json)
  hf           the llava-hf checkpoint to start from (default /data/llama3-llava-next-8b-hf)
  fire_1m      how many FIRE-1M examples the student sees (fire_student: 1000000; the ablation: 200000..1000000)
  released     True: as the released checkpoints were trained: LoRA on q,k,v, the connector trained, and the
               student's r_1 labelled (loss.student_first_turn); False (default): the paper (q,k; Eq. 5)
  base         the model trained (see BASES): llava_next_8b (default; Tables 1-6), open_llava_next_8b (the
               release's own base, Lin-Chen/open-llava-next-llama3-8b in the original LLaVA format, with the
               release's llama_v3_student / llama_v3_teacher templates), llava_next_vicuna_7b (FIRE-LLaVA-Vicuna,
               Table A5) or llava_15_vicuna_7b (FIRE-LLaVA-1.5, Table A6); it sets the model sizes and the default
               hf / tokenizer folders (docs/reproducing.md: which base each table used)
"""

import os

from fire_jax.core.config import InputError, load_config, loss_config, mesh_config, parse_arg, train_config

RECIPES = ("fire100k_student", "fire_student", "fire_teacher")
# Release sizes: FIRE-100K, FIRE-1M (the paper), llava_v1_5_mix665k.json (LLaVA-1.5's instruction mix).
SIZES = {"fire_100k": 100_000, "fire_1m": 1_000_000, "llava_665k": 665_298}
#: The source the Fig. 6 data-size ablation subsamples (``max_examples`` / ``num_examples`` of this key).
ABLATION_SOURCE = "fire_1m"
INSTRUCTION_SOURCE = "llava_665k"

# The 8B sequence budget, from the shipped real FIRE records under Llama 3's tokenizer with anyres images at their
# original sizes (python tools/fire_lengths.py; docs/data.md, "Sequence lengths at 8B"): longest student 3390, teacher
# 3706 tokens; at the default max_len 3072, 11 of 188 student and 22 teacher sequences are cut, 4 / 7 lose every label.
# 4096 cuts none. Buckets follow the distribution (anyres median 2530 / 2718, pad 834 / 1036).
MAX_LEN = 4096
BUCKETS = (1024, 1536, 2048, 2560, 3072, 3584, 4096)


#: The bases the paper trains FIRE on: the model config file beside this one, the checkpoint folder (its
#: tokenizer.json is the default tokenizer) and the chat template (fire_jax/assets/chat_templates; "{role}" is the
#: recipe's student / teacher). Llama-3's at 8B; llava-hf's Vicuna v1 ("USER: ... ASSISTANT:") for
#: LLaVA-NeXT-Vicuna and LLaVA-1.5 (FIRE, Appendix, Tables A5-A6). open_llava_next_8b is the checkpoint the release
#: trained from (MM-FIRE/FIRE README, --model_name_or_path), in the original LLaVA format, with its templates.
BASES = {
    "llava_next_8b": dict(model="llava_next_8b.py", hf="/data/llama3-llava-next-8b-hf", template="llama3",
                          name="LLaVA-NeXT-8B"),
    "open_llava_next_8b": dict(model="open_llava_next_8b.py", hf="/data/open-llava-next-llama3-8b",
                               template="llama_v3_{role}", name="Open-LLaVA-NeXT-8B"),
    "llava_next_vicuna_7b": dict(model="llava_next_vicuna_7b.py", hf="/data/llava-v1.6-vicuna-7b-hf",
                                 template="vicuna_v1", name="LLaVA-NeXT-Vicuna-7B"),
    "llava_15_vicuna_7b": dict(model="llava_15_vicuna_7b.py", hf="/data/llava-1.5-7b-hf", template="vicuna_v1",
                               name="LLaVA-1.5-Vicuna-7B"),
}

#: The options of ``arg`` (after the recipe) with their defaults ("" tokenizer / hf: the base's).
OPTIONS = dict(data_dir="/data/fire_tfds", llava="", images="/data/llava/images", llava_n=-1, llava_ratio=0.0,
               tokenizer="", hf="", fire_1m=SIZES["fire_1m"], released=False, base="llava_next_8b")


def recipe_options(arg: str) -> tuple[str, dict]:
    """``<recipe>[,key=value...]`` -> (recipe, options); the recipe is required."""
    if not arg or "=" in arg.split(",")[0]:
        raise InputError(f"configs/fire.py: the argument starts with a recipe, one of {RECIPES}; got {arg!r}")
    recipe, options = parse_arg(arg, where="configs/fire.py", names=RECIPES, **OPTIONS)
    if "llava_n=" in arg and "llava_ratio=" in arg:
        raise InputError("configs/fire.py: give llava_n (a count) or llava_ratio (per FIRE example), not both")
    if options["base"] not in BASES:
        raise InputError(f"configs/fire.py: base={options['base']!r} unknown; choose from {list(BASES)}")
    base = BASES[options["base"]]
    options["hf"] = options["hf"] or base["hf"]
    options["tokenizer"] = options["tokenizer"] or os.path.join(options["hf"], "tokenizer.json")
    return recipe, options


def fire_sources(recipe: str, o: dict) -> dict:
    """The recipe's FIRE sources (stated sizes as released)."""
    sources = {"fire_100k": dict(tfds=o["data_dir"], split="fire_100k", num_examples=SIZES["fire_100k"])}
    if recipe == "fire_student":
        sources[ABLATION_SOURCE] = dict(tfds=o["data_dir"], split="fire_1m", num_examples=o["fire_1m"],
                                        max_examples=o["fire_1m"])
    return sources


def instruction_count(fire_examples: int, o: dict) -> int:
    """How many LLaVA-665K examples to mix in: all (-1), a count, or a ratio of the FIRE examples."""
    if o["llava_ratio"]:
        return round(o["llava_ratio"] * fire_examples)
    if o["llava_n"] < 0:
        return SIZES[INSTRUCTION_SOURCE]
    return o["llava_n"]


def get_config(arg: str = "fire_student"):
    recipe, o = recipe_options(arg)
    base = BASES[o["base"]]
    config = load_config(os.path.join(os.path.dirname(os.path.abspath(__file__)), base["model"]))
    config.init = dict(hf_checkpoint=o["hf"], adapter="")  # adapter: a LoRA folder of the original format
    if o["released"]:
        config.model.lora.targets = ("q", "k", "v")
    role = "teacher" if recipe == "fire_teacher" else "student"
    sources = fire_sources(recipe, o)
    n = instruction_count(sum(s["num_examples"] for s in sources.values()), o)
    if n:
        where = dict(json=o["llava"], image_root=o["images"]) if o["llava"] else dict(tfds=o["data_dir"],
                                                                                    split="instruct")
        sources[INSTRUCTION_SOURCE] = dict(where, num_examples=n)
        if n != SIZES[INSTRUCTION_SOURCE]:
            sources[INSTRUCTION_SOURCE]["max_examples"] = n  # a fixed random subset (nested: 100K inside 200K)
    config.data = dict(
        tokenizer=o["tokenizer"], image_token="<image>", pad_token="<pad>", role=role,
        teacher_history="full", sources=sources,
        eval_sources={"fire_bench": dict(tfds=o["data_dir"], split="fire_bench")},
        on_bad_record="skip", max_len=MAX_LEN, buckets=BUCKETS, batch_size=64, shuffle=True, seed=0,
        num_epochs=1, num_threads=16, num_workers=8)
    config.data.template = base["template"].format(role=role)  # the base's, whatever tokenizer_config.json says
    config.train = train_config(train_connector=o["released"], accum_steps=8, checkpoint_every=200, shard_init=True)  # 1 example per device per micro-batch on 8 GPUs
    config.loss = loss_config(student_first_turn=o["released"] and role == "student")
    config.mesh = mesh_config((1, -1, 1))  # FSDP over all devices; set (data, fsdp, tensor) per cluster
    return config
