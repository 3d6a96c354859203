"""Bad input ends a CLI with one line naming what and where, exit 2, no traceback."""

import json
import os
import subprocess
import sys

import pytest
from PIL import Image

from fire_jax.core.config import InputError, apply_overrides, load_config, split_overrides

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*argv):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("FIRE_JAX_TRACEBACK", None)
    return subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_config_overrides_on_argparse_clis():
    """--config.x=y works as for the absl CLIs: typed like the field, unknown fields named with the known ones."""
    argv, overrides = split_overrides(["--input", "a.jsonl", "--config.model.llm.dim=64", "--config.data.pad_token=<x>"])
    assert argv == ["--input", "a.jsonl"] and overrides == ["model.llm.dim=64", "data.pad_token=<x>"]
    config = apply_overrides(load_config("configs/tiny.py"), overrides + ["train.lr=1", "data.buckets=(64, 128)"])
    assert config.model.llm.dim == 64 and config.data.pad_token == "<x>"
    assert config.train.lr == 1.0 and isinstance(config.train.lr, float) and tuple(config.data.buckets) == (64, 128)
    with pytest.raises(InputError, match=r"--config.model.llm.dimm=3: no field 'dimm' in model.llm \(known: .*dim"):
        apply_overrides(config, ["model.llm.dimm=3"])
    with pytest.raises(InputError, match=r"--config.modell.x=3: no field 'modell'"):
        apply_overrides(config, ["modell.x=3"])
    with pytest.raises(InputError, match=r"--config.model.llm.dim=abc"):
        apply_overrides(config, ["model.llm.dim=abc"])
    assert apply_overrides(config, ["train.export=false"]).train.export is False  # as config_flags reads bools
    assert apply_overrides(config, ["train.export=True"]).train.export is True
    # A config file's argument is input too: one syntax, errors an InputError (a CLI ends on it in one line).
    with pytest.raises(InputError, match=r"configs/eval_fixed.py: '9b' unknown; choose from \['tiny', '8b'\]"):
        load_config("configs/eval_fixed.py:9b")
    with pytest.raises(InputError, match=r"configs/fire.py: option 'lava_n' unknown"):
        load_config("configs/fire_student.py:lava_n=3")


def test_bad_input_ends_in_one_line(tmp_path):
    # A split in which every record is bad: how many were dropped and why, not tensorflow-datasets' assertion.
    records = tmp_path / "bad.json"
    records.write_text(json.dumps([{"id": "a", "image": "x.png"}, {"id": "b"}, 7]))
    built = run("tools/build_dataset.py", "--json", str(records), "--image_root", str(tmp_path), "--split", "fire_100k",
                "--out", str(tmp_path / "out"))
    last = built.stderr.strip().splitlines()[-1]
    assert built.returncode == 2 and "Traceback" not in built.stderr, built.stderr[-2000:]
    assert "build_dataset: error: no usable record in split 'fire_100k'" in last
    assert "3 bad records dropped (missing_field: 3; e.g." in last and "bad.json: record 0 (id 'a')" in last

    # A config typo and a missing input file in an argparse CLI.
    typo = run("-m", "fire_jax.batch_infer", "--input", str(records), "--output", str(tmp_path / "o.jsonl"),
               "--config.model.llm.dimm=3")
    assert typo.returncode == 2 and "Traceback" not in typo.stderr
    assert typo.stderr.strip().splitlines()[-1].startswith(
        "fire_jax.batch_infer: error: --config.model.llm.dimm=3: no field 'dimm' in model.llm (known:")
    missing = run("-m", "fire_jax.inspect_data", "--config", "configs/nope.py")
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert missing.stderr.strip().splitlines()[-1].startswith(
        "fire_jax.inspect_data: error: config file 'configs/nope.py'")

    # A config file that is not valid JSON where JSON is read: a train workdir's config.json.
    workdir = tmp_path / "run"
    (workdir / "checkpoints").mkdir(parents=True)
    (workdir / "config.json").write_text("{not json")
    Image.new("RGB", (8, 8), "red").save(tmp_path / "red.png")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "p1", "image": "red.png", "question": "What colour?"}) + "\n")
    broken = run("-m", "fire_jax.batch_infer", "--input", str(prompts), "--output", str(tmp_path / "o.jsonl"),
                 "--image_root", str(tmp_path), "--checkpoint", str(workdir))
    assert broken.returncode == 2 and "Traceback" not in broken.stderr, broken.stderr[-2000:]
    assert broken.stderr.strip().splitlines()[-1] == (
        f"fire_jax.batch_infer: error: {workdir / 'config.json'}: not valid JSON: Expecting property name enclosed "
        "in double quotes at line 1 column 2")


def test_absl_clis_find_repo_configs_from_any_directory(tmp_path):
    """`--config configs/x.py` means the repository's file from any directory (as load_config reads it), for the
    absl CLIs too; the default configs are absolute paths."""
    from fire_jax.core.cli import config_argv
    from fire_jax.core.config import CONFIGS_DIR

    os.chdir(tmp_path)
    try:
        assert config_argv(["prog", "--config", "configs/eval_fixed.py:8b", "--workdir", "configs/x"]) == [
            "prog", "--config", os.path.join(ROOT, "configs", "eval_fixed.py") + ":8b", "--workdir", "configs/x"]
        assert config_argv(["prog", "--config=configs/tiny.py"]) == ["prog", f"--config={CONFIGS_DIR}/tiny.py"]
        assert config_argv(["prog", "--config", "nope.py"]) == ["prog", "--config", "nope.py"]
    finally:
        os.chdir(ROOT)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    missing = str(tmp_path / "missing.json")
    result = subprocess.run([sys.executable, "-m", "fire_jax.evaluate", "--config", "configs/eval_fixed.py",
                             "--data_stats", missing, "--workdir", str(tmp_path / "out")], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("fire_jax.evaluate: error:") and "missing.json" in last, last
    typo = subprocess.run([sys.executable, "-m", "fire_jax.train", "--config", "configs/tiny.py", "--workdir",
                           str(tmp_path / "w"), "--config.train.lrr=1"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert typo.returncode == 2 and "Traceback" not in typo.stderr, typo.stderr[-2000:]
    assert typo.stderr.strip().splitlines()[-1].startswith(
        f"fire_jax.train: error: --config.train.lrr: no field 'lrr' in train of {ROOT}/configs/tiny.py (known: ")


def test_make_fire1m_cli_runs_and_resumes(tmp_path):
    """tools/make_fire1m.py end to end on the tiny random models (its flags as its docstring spells them): every
    triplet ends kept or dropped, and a rerun has nothing left to do."""
    assets = os.path.join(ROOT, "fire_jax", "assets", "synthetic_fire")
    out = str(tmp_path / "gen.jsonl")
    argv = ["tools/make_fire1m.py", "--config", "configs/eval_free.py", "--input", os.path.join(assets, "test.json"),
            "--image_root", os.path.join(assets, "images"), "--out", out, "--max_items", "4", "--max_turns", "2",
            "--config.decode.max_new_tokens=6"]
    first = run(*argv)
    assert first.returncode == 0, first.stderr[-3000:]
    done = [json.loads(line) for path in (out, out + ".dropped.jsonl") if os.path.exists(path) for line in open(path)]
    assert len(done) == 4 and len({r["id"] for r in done}) == 4
    again = run(*argv)
    assert again.returncode == 0 and "0 to run" in again.stdout, again.stdout[-2000:]


def test_inspect_renders_a_main_job_stage():
    """--stage picks a main-job config's training config: the teacher stage's record 3 is a one-turn teacher
    example (its reply labelled as turn 1) under the tiny model's Llama-3 template."""
    shown = run("-m", "fire_jax.inspect_data", "--config", "configs/main_job.py:tiny", "--stage", "teacher",
                "--index", "3")
    assert shown.returncode == 0, shown.stderr[-2000:]
    lines = shown.stdout.splitlines()
    assert lines[0] == ("source 'synthetic', record 3 of 1307: id 'synthetic_train_00002_t1', source "
                        "'synthetic_color', role teacher")
    assert lines[1].endswith("labelled per turn {1: 17}")
    assert "[[1|Score: 10.\nFeedback: Correct! Your answer is right.<|eot_id|>]]" in shown.stdout


def test_data_tools_keep_good_records_and_name_bad_ones(tmp_path):
    """A byte that is not UTF-8 in one JSONL record: build_dataset and data.inspect skip and count it (file, record,
    field named) and keep the others; a cut JSON array ends in one line naming the file and byte; an --index out of
    range ends in one line, exit 2."""
    assets = os.path.join(ROOT, "fire_jax", "assets", "synthetic_fire")
    with open(os.path.join(assets, "train.json")) as f:
        records = json.load(f)[:3]
    lines = [json.dumps(r).encode() for r in records]
    lines[1] = lines[1].replace(b"Which", b"Wh\xffich", 1)
    assert b"\xff" in lines[1]
    jsonl = tmp_path / "latin1.jsonl"
    jsonl.write_bytes(b"\n".join(lines) + b"\n")
    bad = f"{jsonl}: record 1 (id {records[1]['id']!r}): field 'question.value': invalid_utf8"
    images = os.path.join(assets, "images")
    built = run("tools/build_dataset.py", "--json", str(jsonl), "--image_root", images, "--split", "x",
                "--out", str(tmp_path / "out"))
    assert built.returncode == 0 and "Traceback" not in built.stderr, built.stderr[-2000:]
    assert "split x: 2 examples" in built.stdout and f"invalid_utf8              1   e.g. {bad}" in built.stdout

    source = f"--config.data.sources.synthetic.json={jsonl}"
    shown = run("-m", "fire_jax.inspect_data", "--config", "configs/tiny.py", source, "--index", "1")
    assert shown.returncode == 0 and "record 1 of 2" in shown.stdout, shown.stderr[-2000:]
    assert bad in shown.stderr
    beyond = run("-m", "fire_jax.inspect_data", "--config", "configs/tiny.py", source, "--index", "2")
    assert beyond.returncode == 2 and beyond.stderr.strip().splitlines()[-1] == (
        "fire_jax.inspect_data: error: --index 2: source 'synthetic' has records 0..1 (2 usable, 1 bad records "
        "skipped)")

    cut = tmp_path / "cut.json"
    cut.write_bytes(json.dumps(records).encode()[:500])
    broken = run("tools/build_dataset.py", "--json", str(cut), "--image_root", images, "--split", "y",
                 "--out", str(tmp_path / "out"))
    assert broken.returncode == 2 and "Traceback" not in broken.stderr
    assert broken.stderr.strip().splitlines()[-1] == (
        f"build_dataset: error: {cut}: not a valid JSON array: the file ends inside a record at byte 500 "
        "(in record 0)")


@pytest.mark.parametrize("argv, last", [
    (["tools/make_synthetic_fire.py", "--out", "o", "--num_train", "-1"],
     "make_synthetic_fire.py: error: argument --num_train: expected an integer >= 1, got -1"),
    (["tools/build_dataset.py", "--json", "a.json", "--image_root", "nope", "--split", "x", "--out", "o"],
     "build_dataset.py: error: argument --image_root: 'nope' is not a directory (it does not exist)"),
    (["tools/fire_lengths.py", "--max_len", "2048,x"],
     "fire_lengths.py: error: argument --max_len: expected comma-separated integers, got '2048,x'"),
    (["tools/hf_generate.py", "--model", "nope", "--inputs", "a", "--out", "b", "--max_new_tokens", "0"],
     "hf_generate.py: error: argument --max_new_tokens: expected an integer >= 1, got 0"),
    (["tools/hf_logits.py", "--model", "nope", "--inputs", "a", "--out", "b"],
     "hf_logits.py: error: argument --model: 'nope' does not exist"),
    (["tools/llama3_tokenizer.py", "--package", "nope"],
     "llama3_tokenizer.py: error: argument --package: 'nope' is not a directory"),
    (["tools/planted_bugs.py", "--only", "no-such-bug"],
     "planted_bugs.py: error: argument --only: no planted bug's name contains any of ['no-such-bug']"),
    (["tools/audit_vlrmbench.py", "nope.jsonl"], "audit_vlrmbench.py: error: argument files: 'nope.jsonl' is not a file"),
    (["tools/make_fire1m.py", "--input", "a", "--image_root", "b", "--out", "c", "--max_turns", "0"],
     "make_fire1m: error: flag --max_turns=0: 0 is not a positive integer"),
    (["-m", "fire_jax.train", "--config", "configs/main_job.py:tiny", "--workdir", "w"],
     "fire_jax.train: error: --config configs/main_job.py:tiny: a main-job config (it has 'base_train'), not a "
     "training config; python -m fire_jax.run runs it"),
    (["-m", "fire_jax.run", "--config", "configs/tiny.py", "--workdir", "w"],
     "fire_jax.run: error: --config configs/tiny.py: a training config (it has 'train'), not a main-job config; "
     "python -m fire_jax.train runs it"),
    (["-m", "fire_jax.evaluate", "--config", "configs/eval_vlrm.py", "--workdir", "w"],
     "fire_jax.evaluate: error: --config configs/eval_vlrm.py: a VLRMBench config (it has 'vlrm'), not a "
     "FIRE-Bench evaluation config; python -m fire_jax.evaluate_vlrm runs it"),
    (["-m", "fire_jax.evaluate_vlrm", "--config", "configs/eval_free.py", "--data_dir", "d"],
     "fire_jax.evaluate_vlrm: error: --config configs/eval_free.py: a FIRE-Bench evaluation config (it has "
     "'setting'), not a VLRMBench config; python -m fire_jax.evaluate runs it"),
    (["-m", "fire_jax.serve", "--config", "configs/main_job.py:tiny"],
     "fire_jax.serve: error: --config configs/main_job.py:tiny: a main-job config (it has 'base_train') has no "
     "'model' field; give a training or evaluation config (configs/tiny.py, configs/smollm2_llava.py, "
     "configs/fire_student.py)"),
    (["-m", "fire_jax.inspect_data", "--config", "configs/main_job.py:tiny"],
     "fire_jax.inspect_data: error: configs/main_job.py:tiny: a main-job config with the stages ['base', "
     "'clip', 'student', 'teacher']: pick one with --stage"),
    (["-m", "fire_jax.inspect_data", "--config", "configs/main_job.py:tiny", "--stage", "fd"],
     "fire_jax.inspect_data: error: --stage 'fd': configs/main_job.py:tiny has the stages ['base', 'clip', "
     "'student', 'teacher']"),
    (["-m", "fire_jax.chat", "--temperature", "3"],
     "fire_jax.chat: error: the command line: temperature must be in [0, 2], got 3.0"),
    (["-m", "fire_jax.evaluate", "--config", "configs/eval_free.py", "--config.decode.max_new_tokens=0",
      "--workdir", "w"],
     "fire_jax.evaluate: error: config.decode: max_new_tokens must be an integer in [1, 2147483647], got 0"),
    (["-m", "fire_jax.inspect_data", "--config", "configs/tiny.py", "--index", "-1"],
     "fire_jax.inspect_data: error: --index -1: source 'synthetic' has records 0..719 (720 usable, 0 bad records "
     "skipped)"),
])
def test_a_tools_bad_argument_ends_in_one_line(argv, last):
    ended = run(*argv)
    assert ended.returncode == 2 and "Traceback" not in ended.stderr, ended.stderr[-2000:]
    assert ended.stderr.strip().splitlines()[-1] == last
    assert not os.path.exists(os.path.join(ROOT, "w"))  # ended before its workdir (and its settings) were written
