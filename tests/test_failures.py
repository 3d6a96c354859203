"""One line for every failure, on every path: outputs written whole or not at all on a full disk, one image-root
check for every loader, release checkpoints and adapters validated, config fields checked where a job takes its
config, a stop by signal that exits 128 + the signal, servers that log a failed request in one line; and a
property-based fuzz over config values and corrupt checkpoint and adapter folders.

The full-disk cases run on a 4 MiB tmpfs (:func:`test_stopping.small_disk`; skipped where none can be mounted).
"""

import ast
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from fire_jax.core.config import InputError, WriteFailed, check_config, error_number, load_config
from fire_jax.core.files import output_folder, save_figure, write_text
from fire_jax.core.results import ResultStore, check_settings, write_json
from loopback import child_env
from test_stopping import fill, small_disk  # noqa: F401 - a fixture

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
PACKAGE = os.path.join(ROOT, "fire_jax")
FULL = r"No space left on device \(0 B free of 4\.0 MiB on its filesystem\)"


def _leftovers(folder) -> list[str]:
    """Temporary files or folders a writer left behind."""
    return sorted(name for name in os.listdir(folder) if ".partial" in name)


# ------------------------------------------------------------------------------------------------ outputs


def _figure(path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure = plt.figure(figsize=(40, 40))  # a big PNG: it cannot fit the page left on the disk
    plt.imshow(np.random.default_rng(0).random((400, 400)))
    save_figure(figure, path, dpi=100)
    plt.close(figure)


WRITERS = {
    "results.json": (lambda path, big: write_json(path, {"big": "x" * (200_000 if big else 1)}),
                     lambda path: json.load(open(path))),
    "summary.md": (lambda path, big: write_text(path, "| a |\n" * (50_000 if big else 1)), lambda path: open(path).read()),
    "settings.json": (lambda path, big: check_settings(path, {"k": "v" * (200_000 if big else 1)}, outputs=()),
                      lambda path: json.load(open(path))),
    "data_statistics.png": (lambda path, big: _figure(path) if big else write_text(path, "old"),
                            lambda path: open(path, "rb").read()),
}


@pytest.mark.parametrize("name", sorted(WRITERS))
def test_an_output_on_a_full_disk_keeps_the_last_good_file_and_says_so_in_one_line(small_disk, name):
    write, read = WRITERS[name]
    path = small_disk / name
    write(path, False)
    before = read(path)
    fill(small_disk, leave=0)
    with pytest.raises(WriteFailed) as failed:
        write(path, True)
    assert re.fullmatch(rf"could not write {re.escape(str(path))}: {FULL}", str(failed.value))
    assert read(path) == before and _leftovers(small_disk) == []


def test_a_new_output_on_a_full_disk_leaves_no_file(small_disk):
    fill(small_disk, leave=0)
    with pytest.raises(WriteFailed, match=FULL):
        write_json(small_disk / "results.json", {"x": "y" * 100_000})
    assert sorted(os.listdir(small_disk)) == ["ballast"]


def test_a_store_cut_by_a_full_disk_keeps_its_whole_lines_and_writes_no_more(small_disk):
    """A failed append is cut back to the last whole line; closing does not write again (it used to flush the
    failed write a second time and raise a second error); a later add says the store is closed."""
    path = small_disk / "fixed_outputs.jsonl"
    store = ResultStore(path, key_field="id")
    store.add({"id": "a", "text": "first"})
    fill(small_disk, leave=0)
    with pytest.raises(WriteFailed, match=rf"could not write {re.escape(str(path))}: {FULL}"):
        store.add_many([{"id": "b", "text": "x" * 300_000}])
    store.close()  # nothing more is written, nothing raised
    assert open(path).read() == '{"id": "a", "text": "first"}\n'
    with pytest.raises(WriteFailed, match="a write has failed, the store is closed for writing"):
        store.add({"id": "c"})
    again = ResultStore.read(path, key_field="id")
    assert list(again) == ["a"]


def test_an_export_on_a_full_disk_keeps_the_last_good_folder(small_disk):
    """The PEFT export (safetensors' own error, "(os error 28)", read as the errno) and a folder of files."""
    from fire_jax.convert.hf import save_peft_adapter
    from fire_jax.weights.build import build_model

    config = load_config(os.path.join(ROOT, "configs", "tiny.py"))
    model = build_model(config)
    adapter = small_disk / "export" / "peft_adapter"
    with output_folder(adapter) as written:
        save_peft_adapter(model, written)
    before = {name: open(adapter / name, "rb").read() for name in os.listdir(adapter)}
    fill(small_disk, leave=0)
    with pytest.raises(WriteFailed) as failed:
        with output_folder(adapter) as written:
            save_peft_adapter(model, written)
    assert re.fullmatch(rf"could not write {re.escape(str(adapter))}: {FULL}", str(failed.value))
    assert {name: open(adapter / name, "rb").read() for name in os.listdir(adapter)} == before
    assert _leftovers(adapter.parent) == []


def test_library_errors_give_their_errno():
    """The errno a library quotes, where it raises no OSError: safetensors (Rust's io::Error), tensorstore."""
    assert error_number(Exception("Error while serializing: I/O error: No space left on device (os error 28)")) == 28
    assert error_number(Exception("IoError(Os { code: 28, kind: StorageFull })")) == 28
    assert error_number(ValueError("write failed [os_error_code='28']")) == 28
    assert error_number(ValueError("a bug, no errno")) is None


def test_a_plot_on_a_full_disk_ends_the_command_in_one_line(small_disk):
    """``evaluate --data_stats``: the plot was a 66-line traceback and a 0-byte PNG."""
    data = os.path.join(ROOT, "tests", "fixtures", "fire", "fire_100k_demo.json")
    out = small_disk / "stats"
    out.mkdir()
    fill(small_disk, leave=0)
    done = subprocess.run([sys.executable, "-m", "fire_jax.evaluate", "--data_stats", data, "--workdir", str(out)],
                          cwd=ROOT, env=child_env(FIRE_JAX_HUGE_PAGES="0"), capture_output=True, text=True,
                          timeout=300)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert re.fullmatch(rf"fire_jax.evaluate: error: could not write {re.escape(str(out))}/data_statistics.png: "
                        f"{FULL}", lines[-1]), lines
    assert os.listdir(out) == []


# ------------------------------------------------------------------------------------------------ image roots


def _outside(tmp_path):
    """An image root whose one image is a symbolic link to a file out of it."""
    from PIL import Image

    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    root.mkdir()
    elsewhere.mkdir()
    Image.new("RGB", (8, 8), "red").save(elsewhere / "secret.png")
    os.symlink(elsewhere / "secret.png", root / "a.png")
    return root


def test_vqa_items_refuse_an_image_out_of_the_root(tmp_path):
    from fire_jax.eval.vqa import read_items

    root = _outside(tmp_path)
    path = tmp_path / "items.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"id": "1", "image": "a.png", "question": "q", "answers": ["red"]},
        {"id": "2", "image": "../elsewhere/secret.png", "question": "q", "answers": ["red"]}]) + "\n")
    items, bad = read_items(str(path), str(root))
    assert items == [] and dict(bad) == {"image_outside_root": 2}
    assert "is a symbolic link out of the image root" in bad.first["image_outside_root"]


def test_clip_captions_refuse_an_image_out_of_the_root(tmp_path):
    from fire_jax.data.captions import _source_records

    root = _outside(tmp_path)
    captions = tmp_path / "captions.json"
    captions.write_text(json.dumps([{"id": "c0", "image": "a.png", "caption": "a red square"}]))
    with pytest.raises(InputError, match=r"record 0 \(c0\): field 'image': image_outside_root \('a.png' is a "
                                         r"symbolic link out of the image root"):
        list(_source_records("captions", {"json": str(captions), "image_root": str(root)}))


#: Functions that join a path naming an image and need no root check, with the reason: what they join is not a
#: user's. (None today: the synthetic writer's and the demo's example joins name no image field.)
JOINS_WITHOUT_A_ROOT: dict[tuple[str, str], str] = {}
ROOT_CHECKS = {"image_path", "outside_root", "check_image"}


def _joins_an_image_path(node) -> bool:
    """``os.path.join(...)`` or ``Path / ...`` over an expression that names an image."""
    if isinstance(node, ast.Call) and ast.unparse(node.func) in ("os.path.join", "join"):
        parts = node.args
    elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        parts = [node.left, node.right]
    else:
        return False
    return any("image" in ast.unparse(part).lower() and "root" not in ast.unparse(part).lower()
               for part in parts[1:] if not isinstance(part, ast.Constant)) or any(
        "image_root" in ast.unparse(part) for part in parts[:1])


def test_every_loader_that_joins_an_image_path_checks_the_root():
    """A function of fire_jax that joins an image named by its input to a folder calls the one root check
    (``data.image_files``: ``image_path`` / ``outside_root``); a new loader that joins paths without it fails here."""
    unchecked = []
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if not name.endswith(".py") or name == "image_files.py":
                continue
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, ROOT)
            for function in ast.walk(ast.parse(open(path).read(), path)):
                if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                inner = list(ast.walk(function))
                if not any(_joins_an_image_path(node) for node in inner):
                    continue
                calls = {ast.unparse(n.func).rsplit(".", 1)[-1] for n in inner if isinstance(n, ast.Call)}
                if not calls & ROOT_CHECKS and (rel, function.name) not in JOINS_WITHOUT_A_ROOT:
                    unchecked.append(f"{rel}:{function.lineno} {function.name}")
    assert unchecked == [], unchecked


def test_the_root_check_sees_these_joins():
    """The detector above on the joins it must catch (so that it cannot pass by seeing nothing)."""
    for source in ('os.path.join(image_root, raw["image"])', 'os.path.join(root, record["image"])',
                   "image_root / p", 'Path(image_root) / record["image"]'):
        assert _joins_an_image_path(ast.parse(source, mode="eval").body), source
    assert not _joins_an_image_path(ast.parse('os.path.join(workdir, "results.json")', mode="eval").body)


def test_every_json_read_names_its_file():
    """No bare ``json.load`` of a user's file in fire_jax: :func:`fire_jax.core.results.read_json` (or
    ``read_json_object``) names the file, line and column; the package's own data files are read directly."""
    own_data = {"fire_jax/vlrmbench/tasks.py", "fire_jax/vlrmbench/score.py", "fire_jax/eval/report.py",
                "fire_jax/eval/vqa.py", "fire_jax/eval/judge.py", "fire_jax/serving/demo.py"}
    bare = []
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, ROOT)
            if not name.endswith(".py") or rel in own_data:
                continue
            for node in ast.walk(ast.parse(open(path).read(), path)):
                if isinstance(node, ast.Call) and ast.unparse(node.func) == "json.load":
                    bare.append(f"{rel}:{node.lineno}")
    assert bare == [], bare


# ------------------------------------------------------------------------------------------------ release folders


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """(base, LoRA folder, the base model) in the original LLaVA format, as the release ships its teacher, from the
    tiny config's model with a LoRA whose factors are not zero."""
    import jax

    from fire_jax.convert import llava
    from fire_jax.weights.build import build_model

    root = tmp_path_factory.mktemp("release")
    config = load_config(os.path.join(ROOT, "configs", "tiny.py"))
    model = build_model(config)
    keys = iter(jax.random.split(jax.random.key(1), 256))
    for layer in model.language_model.model.layers:
        for proj in (layer.self_attn.q_proj, layer.self_attn.v_proj):
            if getattr(proj, "lora_b", None) is not None:
                proj.lora_b[...] = 0.1 * jax.random.normal(next(keys), proj.lora_b[...].shape)
    base, lora = str(root / "base"), str(root / "lora")
    from fire_jax.models import merge_lora

    llava.save_llava_lora(model, lora, base=base)
    merged = merge_lora(model)
    llava.save_llava_checkpoint(merged, base)
    return base, lora, merged


def _copy(folder, to) -> str:
    import shutil

    shutil.copytree(folder, to, symlinks=True)
    return str(to)


def _edit_json(path, changes) -> str:
    """Set each (key, value) of ``changes`` in the JSON object of ``path`` (``_DROP``: remove the key)."""
    config = json.load(open(path))
    for key, value in changes:
        if value is _DROP:
            config.pop(key, None)
        else:
            config[key] = value
    with open(path, "w") as f:
        json.dump(config, f)
    return path


def _adapter_config(folder, **fields):
    return _edit_json(os.path.join(folder, "adapter_config.json"), fields.items())


_DROP = object()


@pytest.mark.parametrize("fields,expected", [
    (dict(r=0), "field 'r' = 0: expected the LoRA rank, an integer >= 1"),
    (dict(r="four"), "field 'r' = 'four': expected the LoRA rank, an integer >= 1"),
    (dict(r=_DROP), "field 'r' = None: expected the LoRA rank, an integer >= 1"),
    (dict(lora_alpha=None), "field 'lora_alpha' = None: expected a positive number"),
    (dict(r=3), "not [r, in] and [out, r] with r = 3"),  # the factors' rank is the model's, not 3
])
def test_a_bad_adapter_config_names_the_file_and_the_field(release, tmp_path, fields, expected):
    from fire_jax.convert.load import load_model

    lora = _copy(release[1], tmp_path / "lora")
    path = _adapter_config(lora, **fields)
    with pytest.raises(InputError) as error:
        load_model(release[0], adapter=lora)
    assert str(error.value).startswith(os.path.join(lora, "adapter_")) and expected in str(error.value)
    assert path in str(error.value) or "adapter_model.safetensors" in str(error.value)


def test_an_adapter_config_that_is_a_list_or_not_json(release, tmp_path):
    from fire_jax.convert.load import load_model

    lora = _copy(release[1], tmp_path / "lora")
    path = os.path.join(lora, "adapter_config.json")
    open(path, "w").write("[1, 2]")
    with pytest.raises(InputError, match=rf"^{re.escape(path)}: expected a JSON object, got list"):
        load_model(release[0], adapter=lora)
    open(path, "w").write("{r: 4")
    with pytest.raises(InputError, match=rf"^{re.escape(path)}: not valid JSON: Expecting property name"):
        load_model(release[0], adapter=lora)


def test_a_bin_that_holds_no_tensors_names_the_file_and_the_key(release, tmp_path):
    import torch

    from fire_jax.convert.load import load_model

    lora = _copy(release[1], tmp_path / "lora")
    path = os.path.join(lora, "non_lora_trainables.bin")
    torch.save({"base_model.model.model.mm_projector.0.weight": [1, 2, 3]}, path)
    with pytest.raises(InputError, match=rf"^{re.escape(path)}: 'base_model.model.model.mm_projector.0.weight' "
                                         r"holds a list, not a tensor$"):
        load_model(release[0], adapter=lora)
    torch.save({7: torch.zeros(2)}, path)
    with pytest.raises(InputError, match=rf"^{re.escape(path)}: key 7 is not a string"):
        load_model(release[0], adapter=lora)


def test_an_index_without_weight_map_names_the_file(release, tmp_path):
    from fire_jax.convert import llava
    from fire_jax.convert.load import load_model

    base = str(tmp_path / "sharded")
    llava.save_llava_checkpoint(release[2], base, max_shard_bytes=200_000)
    index = os.path.join(base, "model.safetensors.index.json")
    open(index, "w").write(json.dumps({"metadata": {}}))
    with pytest.raises(InputError, match=rf"^{re.escape(index)}: field 'weight_map' must be a non-empty object"):
        load_model(base)
    open(index, "w").write(json.dumps({"weight_map": {"x": "../../etc/passwd"}}))
    with pytest.raises(InputError, match=r"names '\.\./\.\./etc/passwd', not a file name of the checkpoint's folder"):
        load_model(base)


# ------------------------------------------------------------------------------------------------ config fields


def test_checkpoint_every_zero_ends_training_in_one_line(tmp_path):
    """It trained a step, then divided by zero."""
    from test_stopping import train_command

    status, out, err = train_command(tmp_path / "run", "--config.train.checkpoint_every=0")
    assert status == 2 and "Traceback" not in err, err[-2000:]
    assert err.strip().splitlines()[-1] == ("fire_jax.train: error: config field train.checkpoint_every = 0: "
                                            "expected an integer >= 1")
    assert not os.path.exists(tmp_path / "run" / "checkpoints")


@pytest.mark.parametrize("spec", ["configs/tiny.py", "configs/clip.py", "configs/main_job.py:tiny",
                                  "configs/main_job.py:smollm2", "configs/main_job.py:smollm2,see",
                                  "configs/fire_student.py", "configs/fire_teacher.py"])
def test_the_shipped_configs_pass_their_checks(spec):
    check_config(load_config(os.path.join(ROOT, spec)))


# ------------------------------------------------------------------------------------------------ signals


def test_a_run_stopped_by_sigterm_exits_143_after_its_checkpoint_committed(tmp_path):
    """Before: exit 0 ("done: step 26/60"), which a scheduler reads as finished; and the stop messages shared
    the progress bar's line."""
    with open(tmp_path / "out", "w") as out_file, open(tmp_path / "err", "w") as err_file:
        process = subprocess.Popen(
            [sys.executable, "-m", "fire_jax.train", "--config", os.path.join(ROOT, "configs", "tiny.py"),
             "--workdir", str(tmp_path / "run"), "--config.train.total_steps=400",
             "--config.train.checkpoint_every=1000", "--config.train.export=False", "--config.data.buckets=(256,)",
             "--config.data.max_len=256"],
            cwd=ROOT, env=child_env(FIRE_JAX_HUGE_PAGES="0"), stdout=out_file, stderr=err_file, text=True)
        try:
            deadline = time.monotonic() + 240
            while not os.path.exists(tmp_path / "run" / "metrics.jsonl") and time.monotonic() < deadline:
                time.sleep(0.2)
            time.sleep(1.0)
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=240)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    out, err = open(tmp_path / "out").read(), open(tmp_path / "err").read()
    assert process.returncode == 128 + signal.SIGTERM, err[-2000:]
    step = int(re.search(r"SIGTERM: checkpoint of step (\d+) committed in ", out).group(1))
    assert os.listdir(tmp_path / "run" / "checkpoints") == [str(step)]  # committed: no orbax tmp folder
    said = [line for line in err.replace("\r", "\n").splitlines() if "SIGTERM" in line or "error" in line]
    assert said == ["SIGTERM: stopping after this step",
                    f"fire_jax.train: stopped by SIGTERM at step {step} of 400; the same command resumes"], said


# ------------------------------------------------------------------------------------------------ server logs


def test_a_failed_demo_request_is_one_line_and_echoes_nothing_refused(capfd):
    from fastapi.testclient import TestClient

    from fire_jax.infer.sampling import SamplingParams
    from fire_jax.serving.demo import create_app

    class Broken:  # a model that fails in a way no handler knows
        max_text_chars = 0

        def start(self, *args):
            raise RuntimeError("the model exploded\nover two lines")

    app = create_app(Broken(), Broken(), {"student": "broken", "teacher": "broken"}, SamplingParams())
    client = TestClient(app, raise_server_exceptions=False)
    png = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC"
    reply = client.post("/api/respond", json={"question": "q", "turns": [], "image": png})
    assert reply.status_code == 500 and reply.json()["error"]["code"] == "model_failure"
    err = capfd.readouterr().err
    assert err.splitlines() == ["fire_jax.demo: POST /api/respond -> 500: RuntimeError: the model exploded over two "
                                "lines"], err
    refused = client.post("/api/record", json={"question": "q", "image_name": "../../etc/passwd",
                                               "turns": [{"response": "a", "feedback": "b"}]})
    assert refused.status_code == 400 and "passwd" not in refused.text
    assert capfd.readouterr().err.splitlines() == ["fire_jax.demo: POST /api/record -> 400"]
    remote = client.post("/api/respond", json={"question": "q", "turns": [], "image": "http://x/secret-name.png"})
    assert remote.status_code == 400 and "secret-name" not in remote.text


# ------------------------------------------------------------------------------------------------ fuzz

FIELDS = [("train", "checkpoint_every"), ("train", "lr"), ("train", "warmup_frac"), ("train", "batch_size"),
          ("train", "accum_steps"), ("train", "total_steps"), ("train", "lr_schedule"), ("train", "epochs"),
          ("train", "keep_checkpoints"), ("train", "b2"), ("loss", "normalize"), ("loss", "max_turns"),
          ("data", "max_len"), ("data", "on_bad_record"), ("data", "num_epochs")]
VALUES = st.one_of(st.integers(-3, 5000), st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.none(),
                   st.text(max_size=6), st.sampled_from(["cosine", "constant", "token", "turn", "skip", "error"]))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(FIELDS), VALUES), min_size=1, max_size=3))
@example(changes=[(("train", "lr"), 3.4028235677973366e38)])  # finite, but its schedule overflows float32
def test_fuzz_config_values_end_in_one_line_or_a_schedule(changes):
    """Any values in the checked fields: one InputError line, or a config whose optimizer and learning-rate
    schedule build and give finite rates over the run (what the trainer computes from them first)."""
    import ml_collections

    from fire_jax.train.step import make_optimizer

    config = load_config(os.path.join(ROOT, "configs", "tiny.py"))
    plain = config.to_dict()
    for (section, field), value in changes:
        plain[section][field] = value
    config = ml_collections.ConfigDict(plain)
    try:
        check_config(config)
    except InputError as error:
        assert "\n" not in str(error) and str(error).startswith("config field ")
        return
    steps = config.train.total_steps or 10
    _, schedule = make_optimizer(config.train, steps)
    rates = [float(schedule(s)) for s in (0, steps // 2, steps - 1)]
    assert all(np.isfinite(rates)) and max(rates) <= config.train.lr * (1 + 1e-6), (changes, rates)
    assert 0 <= (steps - 1) % config.train.checkpoint_every < config.train.checkpoint_every


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(r=st.one_of(st.integers(-2, 9), st.text(max_size=3), st.none(), st.floats(allow_nan=True)),
       alpha=st.one_of(st.integers(-2, 64), st.floats(allow_nan=True), st.none(), st.text(max_size=3)),
       damage=st.sampled_from(["none", "truncate", "drop_factor", "transpose", "bad_json", "list", "extra_key"]))
def test_fuzz_corrupt_adapter_folders_end_in_one_line_or_load(release, tmp_path_factory, r, alpha, damage):
    """A LoRA folder of the release's format, its adapter_config.json and factors damaged at random: loading it
    on its base ends in one InputError line naming a file of the folder, or loads."""
    from safetensors.numpy import load_file, save_file

    from fire_jax.convert.load import load_model

    lora = _copy(release[1], tmp_path_factory.mktemp("fuzz") / "lora")
    _adapter_config(lora, r=r, lora_alpha=alpha)
    weights = os.path.join(lora, "adapter_model.safetensors")
    tensors = load_file(weights)
    first = sorted(tensors)[0]
    if damage == "truncate":
        data = open(weights, "rb").read()
        open(weights, "wb").write(data[: len(data) // 3])
    elif damage == "drop_factor":
        save_file({k: v for k, v in tensors.items() if k != first}, weights)
    elif damage == "transpose":
        save_file({**tensors, first: np.ascontiguousarray(tensors[first].T)}, weights)
    elif damage == "extra_key":
        save_file({**tensors, "base_model.model.model.nope.weight": np.zeros(2, np.float32)}, weights)
    elif damage == "bad_json":
        open(os.path.join(lora, "adapter_config.json"), "w").write('{"r": ')
    elif damage == "list":
        open(os.path.join(lora, "adapter_config.json"), "w").write("[]")
    try:
        load_model(release[0], adapter=lora)
    except InputError as error:
        assert "\n" not in str(error) and str(error).startswith(lora), str(error)


def test_a_failed_server_request_is_one_line(capfd):
    from fastapi.testclient import TestClient

    from fire_jax.serving.server import create_app

    with TestClient(create_app({}), raise_server_exceptions=False) as client:
        capfd.readouterr()
        reply = client.post("/v1/chat/completions", json={"model": "nope", "messages": [
            {"role": "user", "content": "hi"}]})
        assert reply.status_code == 404 and reply.json()["error"]["code"] == "model_not_found"
        assert capfd.readouterr().err.splitlines() == ["fire_jax.serve: POST /v1/chat/completions -> 404"]
        reply = client.post("/v1/chat/completions", content=b"{not json")
        assert reply.status_code == 400
        assert capfd.readouterr().err.splitlines() == ["fire_jax.serve: POST /v1/chat/completions -> 400"]


CHECKPOINT_FIELDS = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                     "intermediate_size", "rms_norm_eps", "rope_theta", "image_grid_pinpoints", "mm_projector_type",
                     "mm_vision_select_layer", "image_aspect_ratio", "mm_patch_merge_type", "mm_vision_tower",
                     "tokenizer_model_max_length", "model_type", "architectures"]
FIELD_VALUES = st.one_of(st.integers(-2, 10**9), st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.none(),
                         st.text(max_size=8), st.sampled_from(["linear", "pad", "anyres", "flat", "llava_llama"]),
                         st.lists(st.lists(st.integers(-1, 700), max_size=3), max_size=3), st.just({}))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(CHECKPOINT_FIELDS), st.one_of(FIELD_VALUES, st.just(_DROP))),
                min_size=1, max_size=3))
@example(changes=[("architectures", 5)])  # not a list
@example(changes=[("model_type", {})])  # not a string (unhashable)
@example(changes=[("model_type", None), ("architectures", None)])  # neither says what the checkpoint is
@example(changes=[("model_type", _DROP), ("architectures", _DROP)])
def test_fuzz_corrupt_checkpoint_configs_end_in_one_line_or_load(release, tmp_path_factory, changes):
    """An original-format checkpoint whose config.json holds damaged fields (any JSON value, or none): loading it
    ends in one InputError line naming its config.json, or loads."""
    from fire_jax.convert.load import load_model

    folder = _copy(release[0], tmp_path_factory.mktemp("fuzz_checkpoint") / "base")
    _edit_json(os.path.join(folder, "config.json"), changes)
    try:
        load_model(folder)
    except InputError as error:
        assert "\n" not in str(error) and str(error).startswith(folder), str(error)
