# The whole FIRE pipeline: train FD (teacher) and FIRE (student), evaluate the baseline and the trained student in
# fixed and free dialogues, print the paper-shaped tables.
#   python -m fire_jax.run                                                   # SmolLM2-135M LLaVA, CPU, ~20 minutes
#   python -m fire_jax.run --config configs/main_job.py:smollm2,compare --workdir runs/compare   # FD from a comparison stage
#   python -m fire_jax.run --config configs/main_job.py:smollm2,see --workdir runs/see   # a vision stage that must see
#   python -m fire_jax.run --config configs/main_job.py:smollm2,rl --workdir runs/main   # + reinforcement after FIRE
#   python -m fire_jax.run --config configs/main_job.py:tiny --workdir /tmp/fire_tiny   # from-scratch tiny, tests
#   python -m fire_jax.run --config configs/main_job.py:8b --workdir /runs/fire_8b
#   python -m fire_jax.run --config configs/main_job.py:8b,llava_n=100000 --workdir /runs/fire_8b   (configs/fire.py options)
"""Pipeline config: one training config per role and the two evaluation settings.

arg "smollm2" (default): configs/smollm2_llava.py, a small LLaVA-NeXT on the pretrained SmolLM2-135M-Instruct, on
the shipped synthetic FIRE set. As LLaVA's tower is a pretrained CLIP, a CLIP (configs/clip.py) is first trained
on the captions of the training images; a base model is then trained on single-turn instruction data (question ->
right answer: what a VLM knows before FIRE) from that CLIP's vision tower: the tower, a fresh connector, LoRA on the
LLM, on the right answers (the groundtruth in the first turn's words). It is the baseline; FD and FIRE start from it
(its LoRA merged) with fresh LoRA adapters.
arg "smollm2,see" (and "tiny,see", either with ",compare"): the seeing lineage. The CLIP stage is a vision stage
(configs/clip.py:see): heads read the facts each caption states on every token of the whole-image tile, dense heads
what each patch holds, on 25,600 fresh drawings, under a tower of 64 px tiles of 16 px patches and 5 layers
(configs/smollm2_llava.py:see); then a connector alignment stage on the captions as chats; then the base stage on
right answers (instruct_right.json), 80 steps of 4. docs/main_job.md, "The seeing lineage": the tower's heads name
the tallest bar on 0.733 of the test images, yet the base model's turn 1 is 0.267 (the default's 0.133; colours come
through, bars and counts do not), an FD that judges but does not compare, about 8,070 GFLOP/s-min.
arg "smollm2,compare" (and "tiny,compare"): FD starts from a comparison stage on the base model instead (text-only
comparisons of a groundtruth with a wrong answer in the teacher's words, merged), then a fresh adapter on teacher
turns a quarter right at a constant lr.
arg "tiny": the same stages (configs/clip.py:tiny first) on configs/tiny.py's from-scratch 2-layer model (seconds a stage: the tests' pipeline).
A tiny model is too small for LoRA alone, so every weight trains (``train.trainable=(".*",)``).
arg "8b[,key=value...]": FD-LLaVA and FIRE-LLaVA from configs/fire_teacher.py / fire_student.py (LoRA on the llava-hf
checkpoint, LLaVA-665K mixed in as the paper did); the options go to both (configs/fire.py: llava_n, llava_ratio,
released, paths). The baseline is the llava-hf LLaVA-NeXT-8B itself.
"""

import os

import ml_collections

from fire_jax.core.config import InputError, load_config

CONFIGS = os.path.dirname(os.path.abspath(__file__))


def _load(name: str):
    return load_config(os.path.join(CONFIGS, name))


def _fire_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("fire_recipes", os.path.join(CONFIGS, "fire.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: The main job's model: configs/tiny.py with a wider LLM (2 layers of 128), the smallest that learns the
#: synthetic task's comparisons (the teacher) and one-step refinements (the student) in CPU minutes.
PIPELINE_LLM = dict(dim=128, heads=4, kv_heads=2, head_dim=32, mlp_dim=384)


def _tiny_train(role: str):
    train = _load("tiny.py")
    train.model.llm.update(PIPELINE_LLM)
    train.data.role = role
    train.loss.student_first_turn = True
    train.train.update(dict(trainable=(".*",), total_steps=300, lr=3e-3, warmup_frac=0.05, checkpoint_every=100))
    return train


#: The comparison stage before the teacher's: the base model's LoRA on text-only comparisons in the teacher's words
#: ("Groundtruth: There are 4.\nAnswer: There are 7." -> "Score: 2.\nFeedback: Your count is too high. ..."; the
#: shipped comparisons.json, synthetic.comparison_records), merged, and the teacher's stage started from it. Through
#: the teacher's own prompt, where some 150 tokens stand between the groundtruth and the answer, the LLM learns the
#: order of two values only after a plateau of a hundred updates or more per task; side by side, within tens.
#: Measured (docs/main_job.md): it teaches the counts' and bars' order, not the colours', for 6 minutes more.
COMPARE_STEPS = 150
#: The SmolLM2 stages: optimizer steps and examples a step. The ",see" lineage's base stage learns to read the tower
#: from right answers, one informative token a sequence (the answer's value): updates more than examples. The
#: teacher's verdict is two tokens of its twenty
#: (the score and the feedback's first word), so it needs updates more than examples: 40 steps of 8 learned the
#: format and the prior ("Score: 10. Correct!" to every answer: agreement 0.52 on fixed dialogues), 160 steps
#: of 2 (the same 320 examples) learned the comparison with the groundtruth (agreement 0.97).
SMOLLM2_STAGES = dict(base=dict(steps=20, batch=8), compare=dict(steps=COMPARE_STEPS, batch=8),
                      align=dict(steps=100, batch=8), base_see=dict(steps=80, batch=4),  # the ",see" lineage
                      teacher=dict(steps=160, batch=2), student=dict(steps=32, batch=8))
#: What the base stage trains besides LoRA: the fresh connector and image_newline, the CLIP stage's tower frozen
#: (LLaVA-1.5's instruction stage; regexes over "/"-joined parameter paths, as
#: ``fire_jax.weights.build.trainable_filter`` matches them). Training the tower too left the base as blind and
#: made the teacher from it worse (docs/main_job.md).
VISION_PARTS = (r"multi_modal_projector/.*", r"image_newline")


def _smollm2_train(role: str, stage: str, see: bool = False):
    train = _load("smollm2_llava.py" + (":see" if see else ""))
    train.data.role = role
    train.loss.student_first_turn = True  # the release labels r_1 too: FIRE keeps the base model's first answers
    steps, batch = SMOLLM2_STAGES[stage]["steps"], SMOLLM2_STAGES[stage]["batch"]
    train.data.batch_size = batch
    train.train.update(dict(total_steps=steps, batch_size=batch, checkpoint_every=steps))
    return train


def _fd_from_comparisons(config, compare_train) -> None:
    """FD's comparison lineage (the ",compare" variants): ``compare_train``, a student-role stage, on the shipped
    comparisons (text only), its export merged, is the teacher's start; the teacher then trains on turns a quarter
    right (more updates on wrong answers, where the direction is learned) at a constant lr (the direction comes at
    once after a plateau, which a decay to 0 leaves no steps for). docs/main_job.md has the figures."""
    compare_train.data.sources = dict(comparisons=dict(json="assets:synthetic_fire/comparisons.json"))
    compare_train.train.export_merged = True
    config.compare_train = compare_train
    config.teacher_train.train.lr_schedule = "constant"
    config.teacher_train.data.sources.synthetic.json = "assets:synthetic_fire/teacher_turns_quarter_right.json"


#: The alignment stage's fresh drawings with their right answers (``data.sources.generated``, beside the caption
#: chats); 0: none, the ",see" lineage's choice. Measured with 1,600 (docs/main_job.md, "The lineage with drawings in
#: its alignment"): the base model's turn 1 rose from 0.267 to 0.367, but FD then called every answer right and the
#: FIRE student no longer moved with the feedback, so the whole lineage ended lower (FIRE 0.367 against 0.500).
ALIGN_GENERATED = 0


def _align(align, base, generated: int = ALIGN_GENERATED) -> None:
    """The connector's alignment stage (after LLaVA-1.5's first stage), ``align``: the CLIP stage's tower under the
    pretrained LLM, the fresh connector and image_newline trained on the training images' captions as chats
    ("Describe the image." -> the caption; the shipped caption_chats.json) and, when ``generated`` > 0, on that
    many fresh drawings with their questions' right answers (``fire_jax.data.sources``, ``generate``: LLaVA-1.5's
    second stage's kind of data, on images no later stage sees), with the LLM's LoRA (which every stage trains;
    LLaVA-1.5 keeps the LLM frozen here), merged; the base stage (``base``) starts from its export. Measured
    (docs/main_job.md): the base model's turn-1 accuracy 0.189 without the stage, 0.278 after 100 steps of 8 on the
    captions, 0.367-0.411 with 1,600 drawings mixed in (:data:`ALIGN_GENERATED`)."""
    align.init.vision_tower = ""  # set to the CLIP stage's export
    align.data.sources = dict(captions=dict(json="assets:synthetic_fire/caption_chats.json",
                                            image_root="assets:synthetic_fire/images"))
    if generated:
        align.data.sources.generated = dict(generate=generated, seed=1, split="align_generated")
    align.train.update(dict(trainable=VISION_PARTS, export_merged=True))
    base.init.hf_checkpoint = ""  # set to the alignment stage's export


def _smollm2(config, compare: bool, see: bool) -> None:
    config.clip_train = _load("clip.py:see" if see else "clip.py")
    config.base_train = _smollm2_train("student", "base_see" if see else "base", see)
    instruct = "instruct_right.json" if see else "instruct.json"
    config.base_train.data.sources = dict(instruct=dict(json=f"assets:synthetic_fire/{instruct}",
                                                         image_root="assets:synthetic_fire/images"))
    if see:
        config.align_train = _smollm2_train("student", "align", see)
        config.align_train.train.lr = 2e-3
        # caption chats are 96-148 SmolLM2 tokens with the system prompt and image (a longer one pads to max_len)
        config.align_train.data.buckets = (160,)
        _align(config.align_train, config.base_train)
    else:
        config.base_train.init.vision_tower = ""  # set to the CLIP stage's export
    config.base_train.train.update(dict(trainable=VISION_PARTS, export_merged=True))
    # Instruction sequences are 110-148 SmolLM2 tokens: one bucket of 160, not 192 (a sixth less compute a step).
    config.base_train.data.buckets = (160,)
    config.teacher_train = _smollm2_train("teacher", "teacher", see)
    # The teacher's 160 steps run its 30 layers unrolled: 2.47 s a step of 2 x 384 where the scanned layers take 2.79
    # on a 2-core Intel Xeon (the stacked weights are sliced out, and the scan's residuals written back, at every
    # layer), for 9 s more compiling per length (benchmarks/main_job_steps.py); the base's 20 steps of 8 (as it then
    # was) broke even, the student's 32 over five lengths do not repay it.
    config.teacher_train.model.scan_layers = False
    config.student_train = _smollm2_train("student", "student", see)
    # Dialogues of one to five turns (110-368 tokens): batches from windows of 8 sorted by length, and a 160 bucket,
    # fill 80% of their padded columns where the shuffled order fills 56% (a third less compute a step).
    config.student_train.data.update(dict(group_by_length=8, buckets=(128, 160, 192, 256, 320, 384, 512)))
    config.teacher_train.data.teacher_history = "latest"  # as in free dialogues (see the tiny branch)
    config.teacher_train.data.sources.synthetic.json = "assets:synthetic_fire/teacher_turns.json"
    if compare:
        _fd_from_comparisons(config, _smollm2_train("student", "compare", see))
        config.compare_train.data.buckets = (96,)  # comparisons are 80-95 SmolLM2 tokens with the system prompt
    model = _load("smollm2_llava.py" + (":see" if see else ""))
    config.eval_fixed = _load("eval_fixed.py:tiny")
    config.eval_fixed.fixed.teacher_history = "latest"
    config.eval_free = _load("eval_free.py:tiny")
    for setting in (config.eval_fixed, config.eval_free):
        setting.model = model.model
        setting.model.update(dict(scan_layers=False, remat="none"))
        setting.data.tokenizer = model.data.tokenizer
        setting.decode.max_new_tokens = 40  # the synthetic answers and feedback fit in 40 SmolLM2 tokens
        setting.decode.batch_size = 32
        setting.decode.bucket_step = 64  # prompts padded to a multiple of 64 (a 290-token teacher prompt: 320, not 512)
    config.eval_fixed.test.max_examples = 30  # fixed dialogues on a third of the test set: the free ones are the point
    config.baseline = dict(name="base (no FIRE)", init="", adapter="")  # init: set to the base model
    config.ablation_source = "synthetic"
    config.exact_teacher_runs = True


#: The ",rl" variant (docs/training.md, "Reinforcement from the teacher's scores"): after FIRE, one reinforcement
#: stage per teacher whose scores are the reward, the exact teacher (the synthetic set's rule) and FD, each then
#: judged in free dialogues beside FIRE. Any workdir of the same size and lineage resumes into it: its finished
#: stages and evaluations are skipped.
RL_REWARD_TEACHERS = ("exact", "fd")
#: Each stage's rollouts (items x dialogues an item) and updates. SmolLM2: 8 rollouts of 16 dialogues; measured on
#: 2 cores at 189 GFLOP/s (docs/main_job.md), the exact teacher's stage 10.9 minutes and FD's 8.1, the two within
#: the variant's 4,000 GFLOP/s-min (fire_jax.stages.main_job.RL_BUDGET) with little room.
RL_STAGES = dict(smollm2=dict(items_per_step=4, group_size=4, iterations=8, lr=1e-3),
                 tiny=dict(items_per_step=4, group_size=4, iterations=6, lr=2e-3))


def _rl(config, size: str) -> None:
    """The ",rl" variant's stage config (configs/fire_rl.py, its student and teacher set by the main job): the free
    dialogues' model, tokenizer, decoding and stop rule, items from the synthetic training set, LoRA (rank and
    targets of the model's) on the FIRE student with its own adapter folded in."""
    rl = _load("fire_rl.py:tiny")
    free = config.eval_free
    rl.model, rl.data = ml_collections.ConfigDict(free.model.to_dict()), ml_collections.ConfigDict(free.data.to_dict())
    rl.free = ml_collections.ConfigDict(free.free.to_dict())
    sizes = RL_STAGES[size]
    rl.rl.update({k: v for k, v in sizes.items() if k != "lr"})
    rl.rl.buckets = (256, 512)  # a turn's prompt and reply: 110-400 tokens; two lengths, few compiled steps
    rows = rl.rl.items_per_step * rl.rl.group_size
    rl.decode = ml_collections.ConfigDict(dict(free.decode.to_dict(), batch_size=rows))
    rl.train.update(dict(lr=sizes["lr"], batch_size=rows, checkpoint_every=rl.rl.iterations))
    if size == "smollm2":
        # The update's rows are a rollout's turns (up to 128 x 512 tokens): the evaluations' unrematerialised 30
        # layers asked for 54 GB; each layer's input alone is kept (about 70 KB a token).
        rl.model.remat = "full"
    config.rl_train = rl
    config.rl_reward_teachers = RL_REWARD_TEACHERS


def get_config(arg: str = "") -> ml_collections.ConfigDict:
    size, _, options = (arg or "smollm2").partition(",")
    chosen = set(options.split(",")) - {""} if size != "8b" else set()
    compare, see = "compare" in chosen, "see" in chosen
    if size not in ("smollm2", "tiny", "8b") or chosen - {"compare", "see", "rl"}:
        raise InputError(f"configs/main_job.py: arg must be 'smollm2[,compare][,see][,rl]', 'tiny[,compare][,see][,rl]' "
                         f"or '8b[,key=value...]', got {arg!r}")
    config = ml_collections.ConfigDict()
    config.compare_train = None  # FD's comparison stage: the ",compare" variants
    config.align_train = None  # the connector's alignment stage, between the CLIP and the base stages: ",see"
    if size == "smollm2":
        _smollm2(config, compare, see)
    elif size == "tiny":
        # The base model: single-turn instruction data (question -> answer), like LLaVA-NeXT before FIRE.
        config.clip_train = _load("clip.py:tiny,see" if see else "clip.py:tiny")
        config.base_train = _tiny_train("student")
        instruct = "instruct_right.json" if see else "instruct.json"
        config.base_train.data.sources = dict(instruct=dict(json=f"assets:synthetic_fire/{instruct}",
                                                             image_root="assets:synthetic_fire/images"))
        if see:
            config.align_train = _tiny_train("student")
            _align(config.align_train, config.base_train, generated=160)  # the tests' run of the generated source
            config.align_train.train.trainable = (".*",)  # the from-scratch LLM learns with it
        else:
            config.base_train.init.vision_tower = ""  # set to the CLIP stage's export
        config.base_train.train.export_merged = True  # FD and FIRE start from base/export/hf_merged
        config.teacher_train, config.student_train = _tiny_train("teacher"), _tiny_train("student")
        # The teacher learns f_k from r_k alone, every turn (assets' teacher_turns.json: one record per turn), as
        # free dialogues use it; under Eq. 6's full history the synthetic f_k follows from f_{k-1}.
        config.teacher_train.data.teacher_history = "latest"
        config.teacher_train.data.sources.synthetic.json = "assets:synthetic_fire/teacher_turns.json"
        if compare:
            _fd_from_comparisons(config, _tiny_train("student"))
            config.compare_train.train.update(dict(total_steps=50, checkpoint_every=50))
        config.eval_fixed = _load("eval_fixed.py:tiny")
        config.eval_fixed.fixed.teacher_history = "latest"  # as trained
        config.eval_free = _load("eval_free.py:tiny")
        for setting in (config.eval_fixed, config.eval_free):
            setting.model.llm.update(PIPELINE_LLM)
            setting.decode.max_new_tokens = 48  # the synthetic answers and feedback fit in 48 tiny-BPE tokens
            setting.decode.batch_size = 16
        config.baseline = dict(name="base (no FIRE)", init="", adapter="")  # init: set to the base model
        config.ablation_source = "synthetic"  # Fig. 6 subsamples the student's synthetic dialogues
        # Also run both students in free dialogues with the exact teacher (the generator's feedback rule).
        config.exact_teacher_runs = True
    else:
        config.teacher_train = _load(f"fire_teacher.py:{options}")
        config.student_train = _load(f"fire_student.py:{options}")
        config.eval_fixed = _load("eval_fixed.py:8b")
        config.eval_free = _load("eval_free.py:8b")
        config.clip_train = config.base_train = None  # the llava-hf checkpoint is the base
        config.baseline = dict(name="LLaVA-NeXT-8B", init=config.eval_free.student.init, adapter="")
        config.exact_teacher_runs = False  # no exact rule for real data
        config.ablation_source = _fire_module().ABLATION_SOURCE  # Fig. 6 subsamples FIRE-1M (configs/fire.py)
    if "rl" in chosen:
        _rl(config, size)
    return config
