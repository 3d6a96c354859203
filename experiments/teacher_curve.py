"""The main job's FD teacher stage, its schedule changed, scored on held-out turns every few hundred updates.

The main job's teacher (160 steps of 2 under a cosine decay, half of its training turns right) learns when an
answer is right but writes the direction of a wrong one at chance. ``experiments/teacher_order.py`` shows, on the
reference side, that the order is learned through the teacher's prompt after enough updates on wrong answers.
This runs the same question through fire_jax's own stage: the main job's teacher config (``configs/main_job.py``:
the image, the paper's prompt, LoRA rank 32 on q, k, v, o, from the main job's base model), trained on the
training set's teacher turns drawn with a share ``--right_share`` of right answers
(``fire_jax.data.synthetic.turn_records``), ``--steps`` steps of ``--batch`` at a constant or cosine lr. Every
``--every`` steps the checkpoint writes greedy feedback on held-out turns drawn the same way from the *test* set
(right half the time) and each reply is scored against the set's rule (``fire_jax.eval.judge.rule_check``):

- agreement: its score solves the item (>= 8, the free dialogues' rule) exactly when the answer is right;
- direction and distance score, on the wrong answers: the rule's feedback text, the rule's score; beside them
  the blind teacher's (``fire_jax.eval.judge.blind_check``: the answer alone, neither the groundtruth nor the
  image), the floor.

    python -m fire_jax.run --workdir runs/smollm2          # the base model the teacher starts from (first)
    python experiments/teacher_curve.py --run runs/smollm2 --out runs/teacher_b1q \\
        --right_share 0.25 --batch 1 --steps 480 --every 160            # ~15 minutes on a 2-core machine
    python experiments/teacher_curve.py --run runs/smollm2 --out runs/teacher_compare \\
        --right_share 0.5 --batch 2 --steps 160 --lr_schedule cosine --every 80 --compare_steps 150   # ~20 minutes

``--compare_steps N`` first runs the main job's comparison stage (``compare_train`` of
``configs/main_job.py:smollm2,compare``: the shipped text-only comparisons, "Groundtruth: ...\\nAnswer: ..." ->
the rule's feedback) for N steps of ``--compare_batch`` and starts the teacher stage from its merged export
(under ``--out/compare``); without it the teacher stage starts from the base model. ``--compare_uniform``
draws the comparisons' wrong answers uniformly among each task's other values instead
(``synthetic.comparison_records(..., uniform=True)``, written under ``--out``), ``--compare_right S`` makes a
share S of them judge the groundtruth itself (``right_share=S``: "Score: 10.\nFeedback: Correct! ...");
``--compare_mix W`` also mixes those comparisons into the teacher stage, a second source of weight W to the
teacher turns' 1. ``--continue_lora`` trains the comparison stage's own LoRA on in the teacher stage (on the base
model, its Adam state fresh) instead of a fresh LoRA on its merged export. ``--short_share S`` renders a share S of
the teacher's training turns short: no instruction message and the judged response cut to its "Answer:" line, so
that the groundtruth stands a few tokens before the answer (the held-out turns keep the paper's prompt).
``--start_adapter DIR`` continues another run's exported LoRA instead (a second phase of that run, on the
same start model, with its own data and schedule). ``--b2`` sets AdamW's second-moment decay, ``--lr`` the
teacher stage's lr.

It prints one line per scored checkpoint and writes ``curve.json``, ``teacher_turns.json`` and each scored
checkpoint's replies beside the rule's (``held_out_<step>.jsonl``) under ``--out``;
``--free`` then runs the main job's free dialogues (its baseline and FIRE students, ``--run``) with the last
checkpoint as the FD teacher and prints the exact judge's figures (about 4 more minutes).
"""

import argparse
import collections
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "main_job.py")


def held_out_turns(count: int) -> list[dict]:
    """The first ``count`` teacher turns of the test set, drawn as the training ones are (right half the time)."""
    from fire_jax.core.config import resolve_path
    from fire_jax.data import synthetic

    with open(resolve_path("assets:synthetic_fire/test.json"), encoding="utf-8") as f:
        return synthetic.turn_records(json.load(f), seed=0)[:count]


def score(turns: list[dict], feedback) -> dict:
    """Agreement over all turns; direction and distance score over the wrong ones, overall and per task."""
    from fire_jax.eval.judge import blind_check, is_right, rule_check
    from fire_jax.dialogue.stop import FREE_DIALOGUE

    out = collections.Counter()
    for record, reply in zip(turns, feedback):
        response, truth = record["conversations"][-2]["value"], record["groundtruth"]["value"]
        out["agreement"] += FREE_DIALOGUE.solves(reply.score) == is_right(response, truth)
        check = rule_check(response, truth, reply.text, reply.score)
        if check is not None:
            task = record["source"].removeprefix("synthetic_")
            out["wrong"] += 1
            out[f"wrong {task}"] += 1
            out["direction"] += check[0]
            out[f"direction {task}"] += check[0]
            out["distance"] += check[1]
            blind = blind_check(response, truth)
            out["blind direction"] += blind[0]
            out["blind distance"] += blind[1]
    return dict(out, turns=len(turns))


def teacher_at(eval_config, base: str, workdir: str, step: int):
    """The FD teacher of ``workdir``'s checkpoint at ``step`` on ``base``, decoding as the main job's evaluations."""
    from fire_jax.eval.fire_bench import model_config
    from fire_jax.dialogue.agents import Teacher
    from fire_jax.infer.backends import InProcess
    from fire_jax.infer.engine_config import EngineConfig
    from fire_jax.infer.loading import load
    from fire_jax.infer.sampling import SamplingParams

    config = model_config(eval_config)
    config.init = dict(hf_checkpoint=base)
    loaded = load(config, workdir, step=step)
    backend = InProcess(loaded.model, loaded.chat, SamplingParams.from_config(eval_config.decode),
                        engine=EngineConfig.from_config(eval_config.decode),
                        batch_size=eval_config.decode.batch_size, description=loaded.description)
    return Teacher(backend, "latest")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", required=True, help="a main job's workdir: its base/export/hf_merged is the start")
    parser.add_argument("--out", required=True, help="the teacher's train workdir (a rerun resumes it)")
    parser.add_argument("--right_share", type=float, default=0.5, help="share of right answers among the turns")
    parser.add_argument("--steps", type=int, default=480)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--lr_schedule", choices=("constant", "cosine"), default="constant")
    parser.add_argument("--b2", type=float, default=None, help="AdamW's second-moment decay (default: the stage's)")
    parser.add_argument("--lr", type=float, default=None, help="the teacher stage's peak lr (default: the stage's)")
    parser.add_argument("--compare_steps", type=int, default=0,
                        help="first this many steps of --compare_batch of the main job's comparison stage "
                             "(configs/main_job.py:smollm2,compare), the teacher stage then starting from its "
                             "merged export")
    parser.add_argument("--compare_batch", type=int, default=8)
    parser.add_argument("--compare_uniform", action="store_true",
                        help="the comparison stage's wrong answers drawn uniformly among each task's other values")
    parser.add_argument("--compare_right", type=float, default=0.0,
                        help="this share of the comparisons judge the groundtruth itself (the rule: 'Score: 10.')")
    parser.add_argument("--continue_lora", action="store_true",
                        help="the teacher stage continues the comparison stage's LoRA on the base model instead of a "
                             "fresh LoRA on its merged export")
    parser.add_argument("--start_adapter", default="",
                        help="a PEFT adapter folder (another run's export/peft_adapter) whose LoRA the teacher stage "
                             "continues, on the model it would start from: a second phase of that run")
    parser.add_argument("--compare_mix", type=float, default=0.0,
                        help="also mix the comparisons into the teacher stage, at this weight against the teacher "
                             "turns' 1 (0: none)")
    parser.add_argument("--short_share", type=float, default=0.0,
                        help="render this share of the training turns short: no instruction message, the judged "
                             "response cut to its Answer line (the same image, question, groundtruth and feedback)")
    parser.add_argument("--every", type=int, default=160, help="score a checkpoint every this many steps")
    parser.add_argument("--held_out", type=int, default=120, help="held-out turns scored")
    parser.add_argument("--free", action="store_true",
                        help="then the main job's free dialogues with the last checkpoint as the FD teacher: the "
                             "baseline and --run's FIRE student, under --out/free")
    args = parser.parse_args()
    if not 0 < args.right_share < 1:
        parser.error(f"--right_share must be between 0 and 1, got {args.right_share}")
    if not 0 <= args.short_share < 1:
        parser.error(f"--short_share must be in [0, 1), got {args.short_share}")

    from fire_jax.core.config import load_config, resolve_path
    from fire_jax.data import synthetic
    from fire_jax.data.chat import answer_of
    from fire_jax.train.loop import train

    base = os.path.abspath(os.path.join(args.run, "base", "export", "hf_merged"))
    if not os.path.isdir(base):
        sys.exit(f"{base}: no base model; run the main job with --workdir {args.run} first")
    os.makedirs(args.out, exist_ok=True)
    with open(resolve_path("assets:synthetic_fire/train.json"), encoding="utf-8") as f:
        turns = synthetic.turn_records(json.load(f), seed=0, right_share=args.right_share)
    data = os.path.abspath(os.path.join(args.out, "teacher_turns.json"))
    with open(data, "w", encoding="utf-8") as f:
        json.dump(turns, f)
    right = sum(t["score"][-1] == 10 for t in turns)
    print(f"{len(turns)} training turns, {right} right ({right / len(turns):.2f}) -> {data}")

    config = load_config(CONFIG)
    student_base = base
    compare = load_config(f"{CONFIG}:smollm2,compare").compare_train  # the default job has none
    comparisons = compare.data.sources.comparisons
    if args.compare_uniform or args.compare_right:  # drawn here rather than the shipped file
        with open(resolve_path("assets:synthetic_fire/train.json"), encoding="utf-8") as f:
            drawn = synthetic.comparison_records(json.load(f), uniform=args.compare_uniform,
                                                 right_share=args.compare_right)
        name = "comparisons" + ("_uniform" if args.compare_uniform else "") + (
            f"_right{args.compare_right}" if args.compare_right else "")
        comparisons.json = os.path.abspath(os.path.join(args.out, name + ".json"))
        with open(comparisons.json, "w", encoding="utf-8") as f:
            json.dump(drawn, f)
    if args.compare_steps:  # the main job's comparison stage, its steps and batch set here
        compare.init.hf_checkpoint = base
        compare.data.update(dict(group_by_length=0, batch_size=args.compare_batch))
        compare.train.update(dict(total_steps=args.compare_steps, batch_size=args.compare_batch,
                                  checkpoint_every=args.compare_steps))
        train(compare, os.path.join(args.out, "compare"))
        if not args.continue_lora:
            base = os.path.abspath(os.path.join(args.out, "compare", "export", "hf_merged"))
    stage = config.teacher_train
    stage.init.hf_checkpoint = base
    if args.compare_steps and args.continue_lora:  # the comparison stage's LoRA, trained on from where it ended
        stage.init.lora_from = os.path.abspath(os.path.join(args.out, "compare", "export", "peft_adapter"))
        print(f"the teacher stage continues the LoRA of {stage.init.lora_from}")
    if args.start_adapter:
        stage.init.lora_from = os.path.abspath(args.start_adapter)
        print(f"the teacher stage continues the LoRA of {stage.init.lora_from}")
    stage.data.sources.synthetic.json = data
    if args.compare_mix:  # comparisons are instruction records: the same messages under either role
        stage.data.sources.comparisons = dict(comparisons.to_dict(), weight=args.compare_mix)
    stage.data.batch_size = args.batch
    stage.train.update(dict(total_steps=args.steps, batch_size=args.batch, lr_schedule=args.lr_schedule,
                            checkpoint_every=args.every, keep_checkpoints=-(-args.steps // args.every)))
    if args.b2 is not None:
        stage.train.b2 = args.b2
    if args.lr is not None:
        stage.train.lr = args.lr
    stage.data.short_teacher_share = args.short_share  # rendered short: no instruction, the "Answer:" line alone
    train(stage, args.out)

    turns = held_out_turns(args.held_out)
    images = [resolve_path(f"assets:synthetic_fire/images/{t['image']}") for t in turns]
    questions = [t["question"]["value"] for t in turns]
    truths = [t["groundtruth"]["value"] for t in turns]
    answers = [t["conversations"][-2]["value"] for t in turns]
    curve = []
    for step in [s for s in range(args.every, args.steps, args.every)] + [args.steps]:
        try:
            teacher = teacher_at(config.eval_free, base, args.out, step)
        except FileNotFoundError as e:  # a workdir trained before with fewer checkpoints kept
            print(f"step {step}: not scored: {e}")
            continue
        feedback = teacher.feedback(images, questions, truths, answers)
        result = dict(score(turns, feedback), step=step, examples=step * args.batch)
        curve.append(result)
        per_task = ", ".join(f"{task} {result.get(f'direction {task}', 0)}/{result[f'wrong {task}']}"
                             for task in ("count", "bars", "color") if result.get(f"wrong {task}"))
        print(f"step {step}: agreement {result['agreement']}/{result['turns']}, direction "
              f"{result['direction']}/{result['wrong']} ({per_task}), distance score "
              f"{result['distance']}/{result['wrong']}; a blind teacher: direction {result['blind direction']}, "
              f"distance score {result['blind distance']}", flush=True)
        for turn, answer, reply in list(zip(turns, answers, feedback))[:6]:
            print(f"  {turn['groundtruth']['value']!r} | {answer_of(answer)!r} -> {reply.text!r}")
        with open(os.path.join(args.out, f"held_out_{step}.jsonl"), "w", encoding="utf-8") as f:
            for turn, answer, reply in zip(turns, answers, feedback):
                f.write(json.dumps(dict(image=turn["image"], source=turn["source"], groundtruth=turn["groundtruth"]
                                        ["value"], answer=answer_of(answer), reply=reply.text, score=reply.score,
                                        rule=synthetic.exact_feedback(turn["groundtruth"]["value"],
                                                                      answer_of(answer))[0])) + "\n")
    with open(os.path.join(args.out, "curve.json"), "w", encoding="utf-8") as f:
        json.dump(dict(vars(args), curve=curve), f, indent=1)
    if args.free:
        free_dialogues(config, base, args.run, args.out, student_base)


#: The exact judge's figures of a free-dialogue run printed by ``--free`` (fire_jax.eval.judge.judged_free).
FREE_FIGURES = ("accuracy_turn1", "accuracy_final", "agreement", "teacher_direction", "teacher_distance_score",
                "solved", "solved_but_wrong")


def free_dialogues(config, base: str, run: str, out: str, student_base: str) -> None:
    """The main job's free dialogues (90 test items) of its baseline and FIRE students (on ``student_base``) with
    this FD teacher (on ``base``)."""
    from fire_jax.stages.main_job import eval_stage

    fd = dict(name="FD (teacher_curve)", init=base, adapter=os.path.abspath(out))
    folder = os.path.join(out, "free")
    students = (("baseline", dict(name="base (no FIRE)", init=student_base, adapter="")),
                ("fire", dict(name="FIRE", init=student_base, adapter=os.path.abspath(os.path.join(run, "student")))))
    for name, student in students:
        baseline = os.path.join(folder, "baseline_free", "results.json") if name == "fire" else ""
        result = eval_stage(config.eval_free, os.path.join(folder, f"{name}_free"), student=student, teacher=fd,
                            baseline_results=baseline)
        judged = result["metrics"]["judged"]["overall"]
        print(f"{name} free dialogues: " + ", ".join(f"{key} {judged.get(key)}" for key in FREE_FIGURES))


if __name__ == "__main__":
    main()
