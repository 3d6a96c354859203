"""VLRMBench with a model: multi-image prompts, the 12 tasks end to end on the tiny model, resume, failures."""

import json
import os
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from PIL import Image

from fire_jax.core.config import load_config
from fire_jax.convert.hf import save_peft_adapter
from fire_jax.data.chat import Message, render
from fire_jax.data.images import pad_tiles
from fire_jax.core.geometry import TEXT
from fire_jax.infer import backends
from fire_jax.infer.forward import image_inputs
from fire_jax.vlrmbench import runner, suite
from fire_jax.vlrmbench.tasks import TASKS

CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "eval_vlrm.py")
SIZES = [(40, 70), (30, 90)]  # tiny geometry: 5 and 4 tiles
FIXTURES = Path(__file__).parent / "fixtures" / "vlrmbench"


def tiny_config(**generate):
    config = load_config(CONFIG)
    # One prompt bucket and one decode length for model and judge: few compiles.
    config.generate.update(dict(batch_size=4, max_new_tokens=8, bucket_min=1024, **generate))
    config.judge.max_new_tokens = 8
    return config


def write_benchmark(root):
    """All 12 task files, 3 usable records each (the second with 2 images), plus one bad SC record."""
    colours = iter(np.random.default_rng(0).integers(0, 255, (200, 3)))
    for task in TASKS:
        lines = []
        for k in range(3):
            images = [f"{task.short}/{k}_{i}.png" for i in range(2 if k == 1 else 1)]
            for i, path in enumerate(images):
                (root / path).parent.mkdir(parents=True, exist_ok=True)
                h, w = SIZES[i]
                Image.new("RGB", (w, h), tuple(int(c) for c in next(colours))).save(root / path)
            record = dict(id=f"{task.short}-{k}", image=images, question=f"How many shapes? ({k})",
                          step_list=["STEP1: Count the shapes.\n\n", "STEP2: There are 3."],
                          reasoning_error="STEP1: Count the shapes.\nSTEP2: There are 4.", category="count")
            record["task_gt"] = {"step": [0, 1], "outcome": k % 2 == 0,
                                 "criticism": "STEP2 miscounts: there are 3 shapes."}[task.theme]
            lines.append(json.dumps(record))
        if task.short == "SC":
            lines.append(json.dumps({**record, "id": "SC-bad", "task_gt": [0, 2]}))  # a label other than 0/1
        (root / f"{task.file}.jsonl").write_text("\n".join(lines) + "\n")
    return root


def prompts_of(task, record):
    """Generations one finished sample took: its task prompts, plus two judge prompts per candidate that came
    back (an empty one too)."""
    task = runner.task_info(task)
    if task.theme == "criticism":
        return 1 + (2 if record["candidate_failure"] in (None, "empty") else 0)
    return runner.num_orders(task.file)


def all_records(workdir):
    return {t.file: runner.read_records(workdir / "outputs" / f"{t.file}.jsonl")[0] for t in TASKS}


class CountingGenerate:
    """Wraps InProcess.generate_ids, every in-process backend's one generation path (the engine):
    counts calls and prompts, can interrupt or fail a call or blank its texts. ``install`` puts it in place."""

    def __init__(self, interrupt_at=None, fail=None, blank=None):
        self.real = backends.InProcess.generate_ids
        self.calls, self.prompts = 0, 0
        self.interrupt_at, self.fail, self.blank = interrupt_at, fail, blank

    def install(self, monkeypatch) -> "CountingGenerate":
        monkeypatch.setattr(backends.InProcess, "generate_ids", lambda backend, *args, **kwargs: self(backend, *args, **kwargs))
        return self

    def __call__(self, agent, prompts, *args, **kwargs):
        self.calls += 1
        if self.calls == self.interrupt_at:
            raise KeyboardInterrupt
        if self.fail and self.fail(prompts):
            raise RuntimeError("device fell over")
        self.prompts += len(prompts)
        texts = self.real(agent, prompts, *args, **kwargs)
        return [""] * len(texts) if self.blank and self.blank(prompts) else texts


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    return write_benchmark(tmp_path_factory.mktemp("vlrmbench"))


@pytest.fixture(scope="module")
def full_run(bench, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("vlrm_full")
    return workdir, suite.evaluate(tiny_config(), str(bench), str(workdir))


# ---------------------------------------------------------------- several images per sample

def handed_to_the_engine(generator, requests) -> list[tuple]:
    """(ids, tiles, sizes) of each request as the responder's in-process backend hands it to its engine
    (``InProcess.generate_ids``, which then generates nothing)."""
    rows = []

    def spy(prompts, pixel_values, image_sizes, *args, **kwargs):
        rows.extend(zip(prompts, pixel_values, image_sizes))
        return [""] * len(prompts)

    generator.backend.generate_ids = spy
    generator(requests)
    return rows


def test_two_images_two_placeholder_blocks_and_their_tiles(bench):
    generator = runner.Responder.from_config(tiny_config(), tiny_config().generate, name="tiny", max_new_tokens=8)
    chat, geometry, n = generator.backend.chat, generator.geometry, generator.geometry.tokens_per_tile

    paths = (str(bench / "SC/1_0.png"), str(bench / "SC/1_1.png"))
    (ids, row_tiles, sizes), bare, typed = handed_to_the_engine(generator, [
        runner.Prompt("Q", paths), runner.Prompt("Q", ()), runner.Prompt("Look at <image> 2.", paths)])
    tiles = [geometry.num_tiles(s) for s in SIZES]
    assert sizes == SIZES and len(row_tiles) == sum(tiles) == 9

    ids = np.asarray(ids)
    is_image = ids == chat.image_token_id
    starts = np.flatnonzero(is_image & ~np.roll(is_image, 1))
    ends = np.flatnonzero(is_image & ~np.roll(is_image, -1)) + 1
    assert (ends - starts).tolist() == [geometry.num_tokens(s) for s in SIZES]  # one block per image, in order
    collapsed = np.concatenate([ids[:starts[0] + 1], ids[ends[0]:starts[1] + 1], ids[ends[1]:]])
    assert chat.decode(collapsed) == render([Message("user", "Q", images=2)], add_generation_prompt=True)

    # A request whose image files were all missing (missing_images="send_without") goes as text alone.
    assert bare[1] is None and list(bare[2]) == []
    assert chat.image_token_id not in bare[0]
    assert chat.decode(bare[0]) == render([Message("user", "Q")], add_generation_prompt=True)
    # A "<image>" in a record's text is text (16 of the shipped image_ref_error records have one).
    assert sum(np.asarray(typed[0]) == chat.image_token_id) == sum(geometry.num_tokens(s) for s in SIZES)
    assert "Look at <image> 2." in chat.decode(typed[0])

    pixel_values = pad_tiles([row_tiles, row_tiles], multiple=geometry.max_tiles)
    assert pixel_values.shape[:2] == (2, 10)  # 9 tiles rounded up to two images' worth
    np.testing.assert_array_equal(pixel_values[0, :9], row_tiles)
    assert not pixel_values[:, 9:].any()
    padded, image_index = image_inputs(generator.backend.model, np.asarray([ids, ids]), pixel_values,
                                       [SIZES, SIZES])
    index = image_index[0]
    newline = padded.shape[1] * n
    first, second = index[starts[0]:ends[0]], index[starts[1]:ends[1]]
    np.testing.assert_array_equal(first[:n], np.arange(n))  # base tile of image 1
    np.testing.assert_array_equal(second[:n], tiles[0] * n + np.arange(n))  # base tile of image 2 after its tiles
    assert first[first != newline].max() < tiles[0] * n <= second[second != newline].min()
    used = np.unique(index[(index != TEXT) & (index != newline)] // n)
    assert used.tolist() == list(range(9))  # every tile of both images is read
    assert (index[~is_image] == TEXT).all()


def test_shipped_records_with_a_typed_image_placeholder_get_one_image_block_per_image(bench, tmp_path):
    """16 of the 58 shipped IC records (the mantis-eval ones) have "<image>" in their question or reasoning:
    their images come from the record's image list, one block each, and the typed "<image>" stays text."""
    generator = runner.Responder.from_config(tiny_config(), tiny_config().generate, name="tiny", max_new_tokens=8)
    chat, geometry = generator.backend.chat, generator.geometry
    records = [json.loads(line) for line in open(FIXTURES / "image_ref_error.jsonl", encoding="utf-8")]
    typed = [r for r in records if "<image>" in r["question"] + r["reasoning_error"]]
    assert len(typed) == 16
    for k, record in enumerate(typed):
        paths = []
        for i, _ in enumerate(record["image"]):
            paths.append(str(tmp_path / f"{k}_{i}.png"))
            Image.new("RGB", (40 + 10 * i, 60)).save(paths[-1])
        text = record["question"] + "\n" + record["reasoning_error"]
        ((ids, _, _),) = handed_to_the_engine(generator, [runner.Prompt(text, tuple(paths))])
        ids = np.asarray(ids)
        assert (ids == chat.image_token_id).sum() == sum(geometry.num_tokens((60, 40 + 10 * i))
                                                         for i in range(len(paths)))
        text_ids = ids[ids != chat.image_token_id]  # the typed ones are tokenised as text, "<", "image", ">"
        assert chat.decode(text_ids).count("<image>") == text.count("<image>") > 0


def test_tile_cap_stops_before_generating(bench, tmp_path, monkeypatch):
    counting = CountingGenerate().install(monkeypatch)
    with pytest.raises(ValueError, match=r"image_ref_error.jsonl:2 \(id IC-1\): its 2 image\(s\) need 9 tiles"):
        suite.evaluate(tiny_config(max_tiles=5), str(bench), str(tmp_path), tasks="IC")
    assert counting.calls == 0


# ---------------------------------------------------------------- the 12 tasks end to end

def test_all_tasks_end_to_end(full_run):
    workdir, results = full_run
    assert json.loads((workdir / "results.json").read_text()) == {k: v for k, v in results.items() if k != "table"}
    assert (workdir / "results.md").read_text() == results["table"]
    assert results["judge"] == "fire_jax (random init) (self)"
    tasks = results["tasks"]
    assert list(tasks) == [t.short for t in TASKS]
    for task in TASKS:
        entry = tasks[task.short]
        assert entry["num_samples"] == 3 and entry["num_outputs"] == (1 if task.short in "SC RD CM EH AH DE SR IC FF"
                                                                      .split() else 2) * 3
        keys = {"step": {"f1", "f1_pos", "f1_neg"}, "outcome": {"accuracy"}, "criticism": {"win", "tie", "lose"}}
        assert set(entry["scores"]) == keys[task.theme]
        assert all(0 <= v <= 1 for v in entry["scores"].values())
        assert 0 <= entry["failures"] <= entry["num_outputs"]
        assert "missing" not in entry["generation_failures"]
    assert tasks["SC"]["bad_records"] == {"bad_field": 1} and tasks["SC"]["kept_records"] == {}
    assert results["step_w_avg"] is not None and results["outcome_w_avg"] is not None

    ours = next(line for line in results["table"].splitlines()
                if line.startswith("| fire_jax (random init) (ours: failures count wrong) |"))
    assert len(ours.split("|")) == 2 + 1 + 18 and " - " not in ours  # model + 18 columns, every one filled
    assert "| fire_jax (random init) (official: the release's scorers) |" in results["table"]
    assert results["accounting"] == "ours" and set(tasks["SC"]["by_accounting"]) == {"ours", "official", "vlmevalkit"}
    assert "ERA/EC judge: fire_jax (random init) (self)" in results["table"]
    assert "| GPT-4o (paper) |" in results["table"]
    assert "| SC | 3 | bad_field 1 | 0 |" in results["table"]
    assert "Label-leak audit" in results["table"] and "| IC | " in results["table"].split("Label-leak audit")[1]

    records = all_records(workdir)
    for task in TASKS:
        assert sorted(records[task.file]) == [f"{task.short}-{k}" for k in range(3)]
    era = records["error_reason_analysis"]["ERA-1"]
    assert set(era) == {"id", "candidate", "candidate_failure", "outputs", "failures"} and len(era["outputs"]) == 2


def test_rerun_resumes_without_redoing_or_losing_samples(bench, full_run, tmp_path, monkeypatch):
    workdir = tmp_path / "run"
    CountingGenerate(interrupt_at=6).install(monkeypatch)  # the sixth call raises KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        suite.evaluate(tiny_config(), str(bench), str(workdir))
    before = all_records(workdir)
    lines_before = {f: (workdir / "outputs" / f"{f}.jsonl").read_text() for f in before if before[f]}
    assert 0 < sum(map(len, before.values())) < 36

    resumed = CountingGenerate().install(monkeypatch)
    results = suite.evaluate(tiny_config(), str(bench), str(workdir))
    after = all_records(workdir)
    expected = sum(prompts_of(task, record) for task, records in after.items() for i, record in records.items()
                   if i not in before[task])
    assert resumed.prompts == expected > 0
    for task, text in lines_before.items():  # finished samples kept as they were, none written twice
        path = workdir / "outputs" / f"{task}.jsonl"
        assert path.read_text().startswith(text)
        assert len(path.read_text().splitlines()) == 3
    assert all(len(records) == 3 for records in after.values())
    assert [results["tasks"][t.short]["num_samples"] for t in TASKS] == [3] * 12

    # A kill while writing leaves a partial line: that sample alone is generated again.
    path = workdir / "outputs" / "multi_solution.jsonl"
    text = path.read_text()
    path.write_text(text[:len(text) - 20])
    again = CountingGenerate().install(monkeypatch)
    suite.evaluate(tiny_config(), str(bench), str(workdir), tasks="SC,MJ")
    assert again.prompts == 2  # MJ-2 in both orders
    assert sorted(runner.read_records(path)[0]) == ["MJ-0", "MJ-1", "MJ-2"]
    assert len(path.read_text().splitlines()) == 3

    # Nothing left to do: no generation, and other settings for the same outputs are refused.
    nothing = CountingGenerate().install(monkeypatch)
    suite.evaluate(tiny_config(), str(bench), str(workdir))
    assert nothing.calls == 0
    config = tiny_config()
    config.vlrm.render = "official"
    with pytest.raises(ValueError, match=r"outputs of step_correctness were generated with other settings.*render"):
        suite.evaluate(config, str(bench), str(workdir), tasks="SC")


def test_failed_generations_are_recorded_counted_and_retried(bench, full_run, tmp_path, monkeypatch):
    workdir, data = tmp_path / "run", tmp_path / "data"
    # SC's one batch raises; an FF image is unreadable; ERA's candidates come back empty, so nothing is judged.
    shutil.copytree(bench, data)
    (data / "FF" / "0_0.png").write_bytes(b"not a png")
    shutil.copytree(full_run[0] / "outputs", workdir / "outputs")
    for task in ("step_correctness", "foresight", "error_reason_analysis"):
        (workdir / "outputs" / f"{task}.jsonl").unlink()
    shutil.copy(full_run[0] / "settings.json", workdir / "settings.json")
    failing = CountingGenerate(fail=lambda prompts: failing.calls == 1,
                               blank=lambda prompts: failing.calls == 3).install(monkeypatch)
    results = suite.evaluate(tiny_config(), str(data), str(workdir), tasks="SC,FF,ERA")
    sc, ff, era = results["tasks"]["SC"], results["tasks"]["FF"], results["tasks"]["ERA"]
    # FF-1, FF-2; the ERA candidates, then the judge on each (empty) candidate in both orders.
    assert ff["generation_failures"] == {"input": 1} and failing.prompts == 2 + 3 + 6
    ff_0 = runner.read_records(workdir / "outputs" / "foresight.jsonl")[0]["FF-0"]
    assert ff_0["outputs"] == [None] and ff_0["failures"][0].startswith("input: UnidentifiedImageError")
    assert sc["generation_failures"] == {"exception": 3} and sc["failures"] == 3
    assert sc["scores"]["f1"] == 0.0  # ours: every label of a failed sample counts wrong
    assert sc["failed_samples"] == {"generation_failed": 3}
    assert sc["by_accounting"]["official"] == {"scores": {"f1": None, "f1_pos": None, "f1_neg": None},
                                               "num_scored": 0}  # official: all three left out
    # Empty candidates are judged (the release judges them) but count as failed samples under ours; the
    # official accounting scores the judge's verdicts. A judge output may itself come back empty.
    era_failures = era["generation_failures"]
    assert "no_candidate" not in era_failures and era_failures["empty"] >= 3 and era["failures"] == 6
    assert era["scores"] == {"win": 0.0, "tie": 0.0, "lose": 1.0} and era["failed_samples"] == {"judge_failed": 3}
    assert era["by_accounting"]["official"]["num_scored"] == 3
    assert sc["by_accounting"]["official"]["num_scored"] == 0  # no line: nothing to score
    assert "| SC | 3 | bad_field 1 | 0 | exception 3 | generation_failed 3 |" in results["table"]
    listed = ", ".join(f"{reason} {n}" for reason, n in sorted(era_failures.items()))
    assert f"| ERA | 3 | 0 | 0 | {listed} | judge_failed 3 |" in results["table"]
    record = runner.read_records(workdir / "outputs" / "step_correctness.jsonl")[0]["SC-0"]
    assert record["outputs"] == [None] and record["failures"][0].startswith("exception: RuntimeError: device fell")

    retry = CountingGenerate().install(monkeypatch)
    results = suite.evaluate(tiny_config(), str(data), str(workdir), tasks="SC,ERA", retry_failed=True)
    assert retry.prompts == 3 + 3 + 2 * 3  # SC; ERA's candidates (their empty ones retried), each judged
    assert "exception" not in results["tasks"]["SC"]["generation_failures"]


# ---------------------------------------------------------------- models

def test_trained_checkpoint_is_evaluated(tmp_path):
    config = tiny_config()
    model = runner.Responder.from_config(config, config.generate, name="base", max_new_tokens=8).backend.model
    for layer in model.language_model.model.layers:
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
            proj.lora_b[...] = jax.random.normal(jax.random.key(1), proj.lora_b[...].shape)
    save_peft_adapter(model, str(tmp_path / "fd_run" / "export" / "peft_adapter"))
    config.checkpoint = str(tmp_path / "fd_run" / "export" / "peft_adapter")
    assert runner.model_name(config) == "fd_run"
    loaded = runner.Responder.from_config(config, config.generate, name="fd_run", max_new_tokens=8).backend.model
    np.testing.assert_array_equal(loaded.language_model.model.layers[1].self_attn.k_proj.lora_b[...],
                                  model.language_model.model.layers[1].self_attn.k_proj.lora_b[...])
    config.judge.checkpoint = config.checkpoint
    config.checkpoint = ""
    assert runner.judge_name(config) == "fd_run" and runner.judge_config(config).checkpoint.endswith("peft_adapter")
    config.judge.checkpoint = ""
    assert runner.judge_config(config) is None and runner.judge_name(config) == "fire_jax (random init) (self)"


# ---------------------------------------------------------------- scripted agents: exact figures

GOOD, BAD = "There are 3.", "There are 4."  # what tell the good solution (step_list) from reasoning_error apart


class Scripted:
    """A generator whose output is a fixed string chosen from each prompt (and, for votes, its position)."""

    def __init__(self, name="scripted", temperature=0.0):
        self.name, self.batch_size, self.max_tiles, self.temperature = name, 4, 0, temperature
        self.prompts = []

    def variant(self, *, name=None, temperature=None, **_):
        other = Scripted(name or self.name, self.temperature if temperature is None else temperature)
        other.prompts = self.prompts
        return other

    def __call__(self, requests, rng=None):
        texts = [self.answer(r.prompt, i) for i, r in enumerate(requests)]
        self.prompts += [r.prompt for r in requests]
        return [(t, None if t else "empty") for t in texts]

    @staticmethod
    def answer(prompt, index):
        k = int(prompt.split("How many shapes? (")[-1][0])  # the sample: write_benchmark's questions
        if "miscounts" in prompt:  # an ERA/EC judge prompt: reference "STEP2 miscounts..." vs the candidate
            if k == 1:
                return "[7, 7]"
            if k == 2:
                return "I cannot judge."
            reference_first = prompt.index("miscounts") < prompt.index("## AI Assistant's Response 2")
            return "[5, 9]" if reference_first else "[9, 5]"  # the candidate is better
        if "identify the steps that contains errors" in prompt:  # SC, 0/1/2-shot
            return {0: {0: "[0, 1]", 1: "STEP 1: 1.\nSTEP 2: 1.", 2: "no idea"}[k], 1: "[1, 1]",
                    2: "[0, 1]"}[prompt.count("## Example")]
        if "Return a List containing two scores" in prompt:  # MJ, either order
            first = prompt.index(GOOD) < prompt.index(BAD)  # the good solution is response 1
            return {0: "[9, 2]" if first else "[2, 9]", 1: "[9, 4]", 2: "[8, 3]" if first else "[5, 5]"}[k]
        if "evaluate whether the given partial reasoning process" in prompt:  # FF
            return {0: "Yes", 1: "Yes.", 2: "Maybe"}[k]
        if "critically analyze the reasoning" in prompt:  # ERA: the candidate critique
            return "Critique: STEP2 says 4."
        return ""  # EC: an empty candidate (judged all the same)


def test_runner_with_scripted_agents_gives_exact_figures(bench, tmp_path, monkeypatch):
    scripted = Scripted()
    monkeypatch.setattr(runner.Responder, "from_config", classmethod(lambda cls, *a, **k: scripted))
    config = tiny_config()
    config.analyses.shots.k = "0,1,2"
    results = suite.evaluate(config, str(bench), str(tmp_path), tasks="SC,MJ,FF,ERA,EC",
                              analyses="positional,length,shots")
    tasks = results["tasks"]
    # SC: labels [0,1 | 0,1 | 0,1]; SC-0 right, SC-1 reads [1, 1], SC-2 unreadable.
    # ours (SC-2 flipped to [1, 0]): TP 2, FP 2, FN 1, TN 1 -> (3 * 4/7 + 3 * 2/5) / 6 = 17/35.
    # official (SC-2 read as [0, 0], as the release pads it): TP 2, FP 1, FN 1, TN 2 -> F1 2/3 each -> 2/3.
    assert tasks["SC"]["scores"]["f1"] == pytest.approx(17 / 35)
    assert tasks["SC"]["by_accounting"]["official"]["scores"]["f1"] == pytest.approx(2 / 3)
    assert tasks["SC"]["failed_samples"] == {"unparsable": 1} and tasks["SC"]["failures"] == 1
    # MJ: MJ-0 right whatever the order, MJ-1 always prefers response 1 (a tie), MJ-2 right only good-first.
    assert tasks["MJ"]["scores"]["accuracy"] == pytest.approx(2 / 3) and tasks["MJ"]["failures"] == 0
    # FF: FF-0 (true) yes, FF-1 (false) yes, FF-2 "Maybe" unreadable (wrong under both: the release
    # finds no yes/no in it).
    assert tasks["FF"]["scores"]["accuracy"] == pytest.approx(1 / 3)
    assert tasks["FF"]["by_accounting"]["official"]["scores"]["accuracy"] == pytest.approx(1 / 3)
    # ERA: ERA-0 the candidate wins in both orders, ERA-1 a tie, ERA-2 the judge answers nothing readable
    # (ours: a loss; official: read as (0, 0) in both orders, a tie).
    assert tasks["ERA"]["scores"] == pytest.approx({"win": 1 / 3, "tie": 1 / 3, "lose": 1 / 3})
    assert tasks["ERA"]["by_accounting"]["official"]["scores"] == pytest.approx({"win": 1 / 3, "tie": 2 / 3,
                                                                                  "lose": 0})
    assert tasks["ERA"]["failed_samples"] == {"unparsable": 1} and tasks["ERA"]["failures"] == 2
    # EC: every candidate empty. Ours: three failed samples, three losses. Official: the judge's verdicts on
    # the empty candidates, as the release judges them: EC-0 a win, EC-1 a tie, EC-2 unread, a tie.
    assert tasks["EC"]["generation_failures"] == {"empty": 3}
    assert tasks["EC"]["scores"] == {"win": 0.0, "tie": 0.0, "lose": 1.0}
    assert tasks["EC"]["failed_samples"] == {"judge_failed": 3}
    assert tasks["EC"]["by_accounting"]["official"] == {
        "scores": pytest.approx({"win": 1 / 3, "tie": 2 / 3, "lose": 0}), "num_scored": 3}
    # vlmevalkit: SC-2 unread, scored as read (all 0) as the release; FF 0 as VLMEvalKit prints it (its
    # `task_gt is True`), 1/3 by value; no ERA/EC. Outcome W-Avg (MJ 2/3, FF 0; 3 samples each): 1/3.
    assert tasks["SC"]["by_accounting"]["vlmevalkit"]["scores"]["f1"] == pytest.approx(2 / 3)
    assert tasks["FF"]["by_accounting"]["vlmevalkit"] == {
        "scores": {"accuracy": 0.0, "accuracy_by_value": pytest.approx(1 / 3)}, "num_scored": 3}
    assert tasks["ERA"]["by_accounting"]["vlmevalkit"]["scores"] == {"win": None, "tie": None, "lose": None}
    assert results["outcome_w_avg_by_accounting"] == {"ours": pytest.approx(0.5), "official": pytest.approx(0.5),
                                                      "vlmevalkit": pytest.approx(1 / 3)}
    # The pooled step F1 (VLMEvalKit's) of SC alone is SC's F1.
    assert results["step_pooled_f1_by_accounting"] == {"ours": pytest.approx(17 / 35),
                                                       "official": pytest.approx(2 / 3),
                                                       "vlmevalkit": pytest.approx(2 / 3)}
    table = results["table"]
    assert "| scripted (ours: failures count wrong) | 48.6 | - |" in table
    assert "| scripted (official: the release's scorers) | 66.7 | - |" in table
    assert "| scripted (vlmevalkit: VLMEvalKit's scorer) | 66.7 | - |" in table
    assert "| scripted (ours: failures count wrong) | - | 48.6 |" in table  # Step W-Avg needs all 8 step tasks
    assert "| SC | 48.6 | 66.7 | 66.7 | 33.3 | 33.3 |" in table  # beside the audit: all_0 = all_1 = 1/3 on [0, 1] x 3

    # The analyses read the same outputs: Table 4 by order, Table 5 by length, Table 6 with scripted k-shot answers.
    analyses = results["analyses"]
    assert analyses["positional"]["better_first"]["accuracy"] == {"ours": 1.0, "official": 1.0}
    assert analyses["positional"]["better_second"]["accuracy"] == {"ours": pytest.approx(1 / 3),
                                                                   "official": pytest.approx(1 / 3)}
    assert analyses["positional"]["better_first"]["mean_response_1"] == pytest.approx(26 / 3)
    assert analyses["length"]["<=10 steps"]["ours"] == pytest.approx(17 / 35)
    shots = analyses["shots"]
    assert shots["0-shot"]["ours"] == pytest.approx(17 / 35)
    assert shots["1-shot"]["ours"] == pytest.approx(1 / 3)  # [1, 1] everywhere: F1_pos 2/3, F1_neg 0, weights 1/2
    assert shots["2-shot"]["ours"] == 1.0
    for name in ("positional", "length", "shots"):
        assert (tmp_path / "analyses" / f"{name}.md").read_text().startswith(analyses[name]["table"].split("\n")[0])
    assert "| GPT-4o (paper) | 73.7 | 71.7 | 70.5 |" in analyses["shots"]["table"]


class Recording:
    """A generator answering every request with one text, keeping the requests (their images)."""

    def __init__(self, text):
        self.name, self.batch_size, self.max_tiles, self.text, self.requests = "recording", 4, 0, text, []

    def __call__(self, requests, rng=None):
        self.requests += list(requests)
        return [(self.text, None) for _ in requests]


def test_shipped_record_whose_image_is_missing(tmp_path, monkeypatch):
    """Three real IC records, the second's image missing. Under accounting="official" its request goes
    without the image and is scored, as the release's clients do; under ours it is a bad record."""
    records = [json.loads(line) for line in open(FIXTURES / "image_ref_error.jsonl", encoding="utf-8")][:3]
    data = tmp_path / "data"
    data.mkdir()
    (data / "image_ref_error.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    for record in (records[0], records[2]):
        path = data / record["image"][0]
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (8, 8)).save(path)
    missing = str(data / records[1]["image"][0])
    # Labels: 13 steps (step 4 wrong), 9 steps (step 4), 14 steps (steps 3 and 8). Every answer names
    # 4 labels, which the release pads with 0: [0, 0, 0, 1, 0, ...].
    recording = Recording("[0, 0, 0, 1]")
    monkeypatch.setattr(runner.Responder, "from_config", classmethod(lambda cls, *a, **k: recording))
    config = tiny_config()
    config.vlrm.accounting = "official"  # missing_images "auto": send_without
    results = suite.evaluate(config, str(data), str(tmp_path / "official"), tasks="IC")
    ic = results["tasks"]["IC"]
    assert [r.images for r in recording.requests] == [(str(data / records[0]["image"][0]),), (),
                                                      (str(data / records[2]["image"][0]),)]
    assert results["missing_images"] == "send_without" and "(missing_images=send_without)" in results["table"]
    assert ic["num_samples"] == 3 and ic["kept_records"] == {"missing_image": 1} and ic["bad_records"] == {}
    # Pooled: 36 steps, 4 wrong; TP 2, FP 1 (step 4 of the third), FN 2, TN 31.
    # F1_pos 4/7, F1_neg 62/65; (32 * 4/7 + 4 * 62/65) / 36 = 838/1365.
    assert ic["scores"]["f1"] == pytest.approx(838 / 1365) and ic["num_scored"] == 3
    assert ic["by_accounting"]["ours"]["scores"]["f1"] == 0.0  # ours: 4 labels for 9-14 steps, all flipped
    assert "| IC | 3 | 0 | missing_image 1 | 0 | 0 |" in results["table"]
    saved = runner.read_records(tmp_path / "official" / "outputs" / "image_ref_error.jsonl")[0]
    assert saved[records[1]["id"]]["missing_images"] == [missing] and "missing_images" not in saved[records[0]["id"]]

    # Ours (the default): the record is skipped and counted; the official figure is then over the other two:
    # 27 steps, 3 wrong; TP 1, FP 1, FN 2, TN 23: (24 * 2/5 + 3 * 46/49) / 27 = 338/735.
    recording.requests.clear()
    results = suite.evaluate(tiny_config(), str(data), str(tmp_path / "ours"), tasks="IC")
    ic = results["tasks"]["IC"]
    assert ic["num_samples"] == 2 and ic["bad_records"] == {"missing_image": 1} and len(recording.requests) == 2
    assert results["missing_images"] == "skip"
    assert ic["by_accounting"]["official"]["scores"]["f1"] == pytest.approx(338 / 735)
    assert "| IC | 2 | missing_image 1 | 0 |" in results["table"]

    # The image found later: the sample sent without it is generated again, the others are reused.
    Image.new("RGB", (8, 8)).save(missing)
    recording.requests.clear()
    suite.evaluate(config, str(data), str(tmp_path / "official"), tasks="IC")
    assert [r.images for r in recording.requests] == [(missing,)]


def test_analyses_on_the_tiny_model_write_tables_and_resume(bench, full_run, tmp_path, monkeypatch):
    from fire_jax.vlrmbench import analyses as vlrm_analyses

    workdir = tmp_path / "run"
    shutil.copytree(full_run[0] / "outputs", workdir / "outputs")  # the main run's outputs are reused
    shutil.copy(full_run[0] / "settings.json", workdir / "settings.json")
    config = tiny_config()
    config.analyses.voting.k = "1,3"
    config.analyses.correction.max_examples = 3
    config.analyses.correction.max_new_tokens = 8
    first = suite.evaluate(config, str(bench), str(workdir), tasks="SC,MJ", analyses="all")["analyses"]
    assert list(first) == list(vlrm_analyses.ANALYSES)
    for name, paper_row in (("positional", "| better_first | GPT-4o (paper) | 9.8 | 7.8 | 52.2 |"),
                            ("length", "| GPT-4o (paper) | 77.8 | 75.2 | 68.6 |"),
                            ("shots", "| GPT-4o (paper) | 73.7 | 71.7 | 70.5 |"),
                            ("voting", "| SC | fire_jax (random init) (ours) |"),
                            ("correction", "| LVLM 7B / VLRM 72B (paper) | 21.8 | 19.7 | 21.5 | 21.0 |")):
        text = (workdir / "analyses" / f"{name}.md").read_text()
        assert paper_row in text and text == first[name]["table"]
        assert json.loads((workdir / "analyses" / f"{name}.json").read_text()) == {
            k: v for k, v in first[name].items() if k != "table"}
    assert first["length"]["<=10 steps"]["samples"] == 3 and first["voting"]["SC"]["3"]["no_vote_read"] <= 3
    votes = runner.read_records(workdir / "analyses" / "voting" / "step_correctness.jsonl")[0]
    assert {i: r["seed"] for i, r in votes.items()} == {f"SC-{k}": vlrm_analyses.sample_seed(0, "SC", f"SC-{k}")
                                                        for k in range(3)}
    assert all(len(r["outputs"]) == 3 for r in votes.values())
    assert first["correction"]["overall"]["items"] == 3

    # A rerun generates nothing: every analysis resumes from its files.
    counting = CountingGenerate().install(monkeypatch)
    again = suite.evaluate(config, str(bench), str(workdir), tasks="SC,MJ", analyses="all")["analyses"]
    assert counting.calls == 0
    assert {k: v["table"] for k, v in again.items()} == {k: v["table"] for k, v in first.items()}
    config.analyses.voting.temperature = 0.5
    with pytest.raises(ValueError, match=r"analyses/voting: its outputs were generated with other settings"):
        suite.evaluate(config, str(bench), str(workdir), tasks="SC,MJ", analyses="voting")


# ---------------------------------------------------------------- an endpoint as the model and the judge

@pytest.fixture(scope="module")
def served():
    """The config's random tiny model behind ``python -m fire_jax.serve`` on a loopback port."""
    from loopback import server

    with server("fire_jax.serve", ["--config", CONFIG, "--model", "tiny=random", "--cache_len", "1024",
                                   "--slots", "8"], "/health") as (_, base):
        yield base


def test_api_model_and_judge_give_the_in_process_results(bench, full_run, served, tmp_path):
    """The evaluated model and the ERA/EC judge as api: specs on the loopback server == the in-process run."""
    spec = f"api:{served}/v1#tiny"
    local_dir, local = full_run
    config = tiny_config()
    config.checkpoint = spec
    remote = suite.evaluate(config, str(bench), str(tmp_path / "api"))
    assert remote["model"] == f"tiny ({served}/v1)" and remote["judge"] == f"tiny ({served}/v1) (self)"
    assert all_records(tmp_path / "api") == all_records(local_dir)
    assert {k: v["scores"] for k, v in remote["tasks"].items()} == {k: v["scores"] for k, v in local["tasks"].items()}
    texts = [t for records in all_records(local_dir).values() for r in records.values() for t in r["outputs"] if t]
    assert len(texts) > 40 and len(set(texts)) > 20  # real, varied outputs: the comparison can fail

    config = tiny_config()
    config.judge.checkpoint = spec  # the in-process model's critiques, judged by the endpoint
    judged = suite.evaluate(config, str(bench), str(tmp_path / "judge"), tasks="ERA,EC")
    assert judged["judge"] == f"tiny ({served}/v1)"
    for task in ("error_reason_analysis", "error_correction"):
        assert runner.read_records(tmp_path / "judge" / "outputs" / f"{task}.jsonl")[0] == all_records(local_dir)[task]
