"""Planted-bug check: does each test file catch a small, realistic bug in the code it guards?

    python tools/planted_bugs.py                 # every bug; prints a caught/missed table
    python tools/planted_bugs.py --only step_    # bugs whose name contains "step_"
    python tools/planted_bugs.py --check         # only check that every patch still applies
    python tools/planted_bugs.py --list

The working tree (tracked and untracked, not ignored files) is copied to a scratch directory once. Each bug is
an exact search/replace on one source file, applied alone to the copy; the bug's test files then run with
``python -m pytest -x -q`` there (the copy's ``fire_jax`` first on the path). A failing test run is "caught",
a green one "MISSED", a search string found zero or several times "STALE" (the code moved: update the patch).
First the unpatched test files run once ("baseline"); tests that already fail there are deselected from the
patched runs (and listed), so "caught" always means a test that passes without the bug fails with it.
Not run by CI: a full run takes tens of minutes on CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Bug:
    name: str
    path: str  # source file, relative to the repository root
    search: str  # exact text, present once in the file
    replace: str
    tests: tuple[str, ...]  # test files (or node ids) that should catch it
    what: str = ""


STEP, LOSS = "fire_jax/train/step.py", "fire_jax/train/loss.py"
CHAT, SCORES, TEMPLATES = "fire_jax/data/chat.py", "fire_jax/data/scores.py", "fire_jax/data/templates.py"
FIXED, FREE, METRICS = "fire_jax/eval/fixed.py", "fire_jax/dialogue/stop.py", "fire_jax/eval/metrics.py"
AGENTS = "fire_jax/dialogue/agents.py"
TRAIN_TESTS = ("tests/test_train.py",)
RUNNER_TESTS = ("tests/test_runners.py",)

BUGS = [
    # ---- the six that once went through the tests
    Bug("step_loss_mask_is_attention", STEP, 'mask = batch["loss_mask"][:, 1:]', 'mask = batch["attention_mask"][:, 1:]',
        TRAIN_TESTS, "train step uses attention_mask as the loss mask"),
    Bug("step_turn_ids_shifted", STEP, 'turns = batch["turn_ids"][:, 1:]', 'turns = batch["turn_ids"][:, :-1]',
        TRAIN_TESTS, "train step shifts turn_ids by one token"),
    Bug("step_labels_all_before_last_answer", STEP, 'mask = batch["loss_mask"][:, 1:].astype(jnp.float32)',
        'mask = (jnp.cumsum(batch["loss_mask"][:, ::-1], axis=1)[:, ::-1] > 0)[:, 1:].astype(jnp.float32)',
        TRAIN_TESTS, "train step labels everything before the last answer token"),
    Bug("fixed_prediction_reference_swapped", FIXED,
        'text_metrics([compared(r["prediction"]) for r in records], [compared(r["reference"]) for r in records])',
        'text_metrics([compared(r["reference"]) for r in records], [compared(r["prediction"]) for r in records])',
        RUNNER_TESTS, "fixed dialogues: prediction and reference swapped in BLEU/CIDEr"),
    Bug("fixed_teacher_score_line_kept", FIXED,
        'compared = (lambda text: release_reading(text)[1]) if teacher and teacher_text == "feedback" else (lambda t: t)',
        "compared = lambda text: text", RUNNER_TESTS,
        'fixed dialogues: teacher_text="feedback" still scores the "Score:" line'),
    Bug("fixed_teacher_score_line_always_dropped", FIXED,
        'compared = (lambda text: release_reading(text)[1]) if teacher and teacher_text == "feedback" else (lambda t: t)',
        "compared = (lambda text: release_reading(text)[1]) if teacher else (lambda t: t)", RUNNER_TESTS,
        'fixed dialogues: teacher_text="whole" drops the "Score:" line'),
    Bug("fixed_release_feedback_kept_unscored", FIXED, "    if score is None or not marker:\n        return None, \"\"",
        "    if not marker:\n        return score, \"\"", RUNNER_TESTS,
        "fixed dialogues: the release's reading keeps the feedback of a reply without a first-line score"),
    Bug("free_official_zero_goes_on", FREE, 'if rule.score_parser == "official" and score == 0:',
        'if rule.score_parser == "official" and score < 0:', RUNNER_TESTS,
        "free dialogues: the release's score reading does not stop on a real 0"),
    Bug("parse_score_official_any_line", SCORES,
        'numbers = _RELEASE_SCORE.findall(lines[0]) if lines and "Score:" in lines[0] else []',
        'numbers = next((_RELEASE_SCORE.findall(x) for x in lines if "Score:" in x), [])',
        ("tests/test_data_records.py",), "parse_score(parser='official') reads a score line after the first"),
    Bug("judge_case_sensitive", "fire_jax/eval/judge.py", ".strip().casefold()", ".strip()", ("tests/test_judge.py",),
        "exact judge: case not folded"),
    Bug("judge_final_is_first", "fire_jax/eval/judge.py", "final = [r[-1] for r in right if r]",
        "final = [r[0] for r in right if r]", ("tests/test_judge.py",), "exact judge: final accuracy reads turn 1"),
    Bug("judge_solved_but_wrong_ignores_stop", "fire_jax/eval/judge.py",
        'if record.get("stop") == "solved" and rs)', "if rs)", ("tests/test_judge.py",),
        "exact judge: solved-but-wrong counts every dialogue that ends wrong"),
    Bug("vlrm_judge_pair_order_reversed", "fire_jax/vlrmbench/runner.py", "for k in judged for order in (0, 1)",
        "for k in judged for order in (1, 0)", ("tests/test_vlrm_runner.py",),
        "VLRMBench runner: ERA/EC judge pair order reversed (tests owned by the VLRMBench work)"),
    # ---- train step and loss
    Bug("step_targets_not_shifted", STEP, 'targets = batch["input_ids"][:, 1:]', 'targets = batch["input_ids"][:, :-1]',
        TRAIN_TESTS, "the loss predicts the current token instead of the next"),
    Bug("step_accum_grads_averaged", STEP, "return jax.tree.map(jnp.add, grads, g), (nll, correct)",
        "return jax.tree.map(lambda a, b: a + b / accum, grads, g), (nll, correct)", TRAIN_TESTS,
        "gradient accumulation divides the (already globally weighted) micro-batch gradients by accum"),
    Bug("step_accum_contiguous_microbatches", STEP,
        "return x.reshape(x.shape[0] // accum, accum, *x.shape[1:]).swapaxes(0, 1)",
        "return x.reshape(accum, x.shape[0] // accum, *x.shape[1:])", TRAIN_TESTS,
        "micro-batches cut contiguously while the metrics un-stride them (nll rows meet other rows' weights)"),
    Bug("step_turn_loss_over_all_tokens", STEP,
        "losses.turn_counts(mask * nll, turns, max_turns) / jnp.maximum(turn_tokens, 1.0)",
        "losses.turn_counts(mask * nll, turns, max_turns) / jnp.maximum(tokens, 1.0)", TRAIN_TESTS,
        "per-turn loss divided by all labelled tokens instead of the turn's"),
    Bug("loss_turn_weights_not_split_over_turns", LOSS, "1.0 / (present * jnp.maximum(count, 1.0))",
        "1.0 / jnp.maximum(count, 1.0)", TRAIN_TESTS, 'normalize="turn" weights sum to the number of turns'),
    # ---- chat masks and parsers
    Bug("chat_student_first_turn_labelled", CHAT, "i if (i >= 2 or first_turn_labelled) else -1",
        "i if (i >= 1 or first_turn_labelled) else -1", ("tests/test_data_chat.py",),
        "student loss labels r_1 without loss.student_first_turn"),
    Bug("chat_eot_not_labelled", TEMPLATES, 'pieces.append(Piece(end, "template", close))',
        'pieces.append(Piece(end, "template", -1))', ("tests/test_data_chat.py", "tests/test_chat_templates.py"),
        "an assistant turn's end token (<|eot_id|>, <|im_end|>) is not labelled"),
    Bug("chat_teacher_trained_without_score", CHAT, 'messages.append(Message("assistant", turn.feedback, i))',
        'messages.append(Message("assistant", turn.feedback_text, i))', ("tests/test_data_chat.py",),
        "teacher targets f_i without its score line"),
    Bug("parse_score_ten_rejected", SCORES, "if not 0 <= value <= 10:", "if not 0 <= value < 10:",
        ("tests/test_data_records.py",), 'parse_score("Score: 10") gives None'),
    Bug("feedback_text_keeps_score", SCORES, "        return tail.strip()\n", "        return feedback.strip()\n",
        ("tests/test_data_records.py", "tests/test_runners.py"), "the student is shown the score line"),
    # ---- free-dialogue stop rules and metrics
    Bug("stop_solved_strict", FREE, "return score is not None and score >= self.threshold",
        "return score is not None and score > self.threshold", (*RUNNER_TESTS, "tests/test_judge.py"),
        "a score equal to the threshold does not solve the item (nor is it the teacher's \"right\" for the judge)"),
    Bug("stop_no_increase_strict", FREE, "score <= scores[-2]", "score < scores[-2]", RUNNER_TESTS,
        "an equal score does not stop the dialogue"),
    Bug("stop_max_turns_late", FREE, "if len(scores) >= rule.max_turns:", "if len(scores) > rule.max_turns:",
        RUNNER_TESTS, "one turn past max_turns"),
    Bug("metric_atr_divides_by_turns", METRICS, "(last - first) / (num_turns - 1)", "(last - first) / num_turns",
        ("tests/test_metrics.py", "tests/test_runners.py"), "ATR normalised by n_k instead of n_k - 1"),
    Bug("metric_rr_ignores_first", METRICS, "(last >= threshold).astype(float) - (first >= threshold)",
        "(last >= threshold).astype(float)", ("tests/test_metrics.py", "tests/test_runners.py"),
        "RR counts solved items, not refined ones"),
    Bug("metric_at_penalty_strict", METRICS, "np.where(last >= threshold, num_turns, penalty_turns)",
        "np.where(last > threshold, num_turns, penalty_turns)", ("tests/test_metrics.py", "tests/test_runners.py"),
        "a final score equal to the threshold costs the penalty turns"),
    Bug("metric_mae_missing_free", METRICS, "errors.append(missing_penalty)", "errors.append(0.0)",
        ("tests/test_metrics.py", "tests/test_runners.py"), "a teacher reply without a score costs nothing"),
    Bug("metric_bleu_no_brevity_penalty", METRICS, "np.where(ratio < 1, np.exp(1 - 1 / ratio), 1.0)",
        "np.ones_like(ratio)", ("tests/test_metrics.py", "tests/test_runners.py"), "BLEU without brevity penalty"),
    # ---- fixed-dialogue runner and agents
    Bug("fixed_student_history_too_long", FIXED, "histories = [t.record.turns[:t.turn - 1] for t in turns]",
        "histories = [t.record.turns[:t.turn] for t in turns]", RUNNER_TESTS,
        "the student sees the true r_k it is asked to generate"),
    Bug("fixed_teacher_scores_previous_answer", FIXED,
        "answers = [t.record.turns[t.turn - 1].response for t in turns]",
        "answers = [t.record.turns[t.turn - 2].response for t in turns]", RUNNER_TESTS,
        "the teacher scores r_{k-1} instead of r_k"),
    Bug("fixed_student_first_turn_always", FIXED, '"student": 1 if student_first_turn else 2',
        '"student": 1', RUNNER_TESTS, "fixed dialogues generate r_1 for the student without student_first_turn"),
    Bug("fixed_reference_of_other_role", FIXED, '"reference": truth.feedback if teacher else truth.response',
        '"reference": truth.response if teacher else truth.feedback', RUNNER_TESTS,
        "student predictions compared with feedback and teacher predictions with responses"),
    Bug("agents_teacher_score_dropped", AGENTS, "Feedback(text, parse_score(text))", "Feedback(text, None)",
        ("tests/test_infer.py",), "Teacher.feedback returns no score"),
]


def _scratch_copy(dest: str) -> None:
    """Tracked and untracked (not ignored) files of the working tree, as they are now."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = os.path.join(ROOT, rel)
        if os.path.isfile(src):
            os.makedirs(os.path.dirname(os.path.join(dest, rel)), exist_ok=True)
            shutil.copy2(src, os.path.join(dest, rel))


def _pytest(scratch: str, tests, timeout: int, *, stop_first: bool = True, deselect=()) -> tuple[int, str, float]:
    env = {**os.environ, "PYTHONPATH": scratch + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *(["-x"] if stop_first else []),
           *tests, *(f"--deselect={node}" for node in deselect)]
    start = time.time()
    try:
        proc = subprocess.run(cmd, cwd=scratch, env=env, capture_output=True, text=True, timeout=timeout)
        return proc.returncode, proc.stdout + proc.stderr, time.time() - start
    except subprocess.TimeoutExpired:
        return -1, "timeout", time.time() - start


def _failures(output: str) -> list[str]:
    """Node ids of the failed / errored tests in a ``pytest -q`` summary."""
    return re.findall(r"^(?:FAILED|ERROR) (\S+)", output, re.M)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", default=(), help="run the bugs whose name contains one of these")
    parser.add_argument("--check", action="store_true", help="only check that every patch applies")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--no_baseline", action="store_true", help="skip the unpatched run of the test files")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per test run")
    args = parser.parse_args()
    if args.timeout < 1:
        parser.error(f"argument --timeout: expected a positive number of seconds, got {args.timeout}")
    bugs = [b for b in BUGS if not args.only or any(s in b.name for s in args.only)]
    if not bugs:
        parser.error(f"argument --only: no planted bug's name contains any of {list(args.only)}")
    if args.list:
        for b in bugs:
            print(f"{b.name:42s} {b.path:32s} {' '.join(b.tests)}\n    {b.what}")
        return 0

    stale = []
    for b in bugs:
        with open(os.path.join(ROOT, b.path)) as f:
            count = f.read().count(b.search)
        if count != 1:
            stale.append(b.name)
            print(f"STALE {b.name}: {b.search!r} found {count} times in {b.path}")
    if args.check:
        print(f"{len(bugs) - len(stale)}/{len(bugs)} patches apply")
        return 1 if stale else 0

    scratch = tempfile.mkdtemp(prefix="planted_bugs_")
    _scratch_copy(scratch)
    env = {**os.environ, "PYTHONPATH": scratch}
    where = subprocess.run([sys.executable, "-c", "import fire_jax; print(fire_jax.__file__)"], cwd=scratch,
                           env=env, capture_output=True, text=True).stdout.strip()
    if not where.startswith(scratch):
        raise SystemExit(f"the scratch copy's fire_jax is not the one imported ({where})")
    print(f"scratch copy: {scratch}")

    red = {}  # test files -> tests failing without any bug
    if not args.no_baseline:
        for tests in sorted({b.tests for b in bugs if b.name not in stale}):
            rc, output, seconds = _pytest(scratch, tests, args.timeout, stop_first=False)
            red[tests] = _failures(output)
            print(f"baseline {' '.join(tests)}: rc={rc}, {len(red[tests])} failing ({seconds:.0f} s)", flush=True)
            for node in red[tests]:
                print(f"    already failing, deselected: {node}")
            if rc not in (0, 1) or (rc == 1 and not red[tests]):
                print(output[-3000:])
                raise SystemExit(f"the unpatched {' '.join(tests)} do not run: fix them before planting bugs")

    rows = []
    for b in bugs:
        if b.name in stale:
            rows.append((b, "STALE", 0.0, ""))
            continue
        path = os.path.join(scratch, b.path)
        with open(path) as f:
            original = f.read()
        with open(path, "w") as f:
            f.write(original.replace(b.search, b.replace))
        try:
            rc, output, seconds = _pytest(scratch, b.tests, args.timeout, deselect=red.get(b.tests, ()))
        finally:
            with open(path, "w") as f:
                f.write(original)
        result = {0: "MISSED", 1: "caught"}.get(rc, "timeout" if rc == -1 else f"error rc={rc}")
        failed = _failures(output)
        rows.append((b, result, seconds, failed[0].split("/")[-1] if failed else ""))
        print(f"{result:8s} {b.name} ({seconds:.0f} s) {rows[-1][3]}", flush=True)

    print("\n| planted bug | file | tests run | result | first failing test |\n|---|---|---|---|---|")
    for b, result, seconds, failure in rows:
        print(f"| {b.name} | {b.path} | {' '.join(os.path.basename(t) for t in b.tests)} | {result} | {failure} |")
    caught = sum(r == "caught" for _, r, _, _ in rows)
    print(f"\ncaught {caught}/{len(rows)}; missed {sum(r == 'MISSED' for _, r, _, _ in rows)}; "
          f"stale {sum(r == 'STALE' for _, r, _, _ in rows)}; other {sum(r not in ('caught', 'MISSED', 'STALE') for _, r, _, _ in rows)}")
    shutil.rmtree(scratch, ignore_errors=True)
    return 0 if caught == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
