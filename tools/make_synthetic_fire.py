"""Write a synthetic FIRE dataset (drawn images, checkable answers) and train the tiny tokenizer on it.

    python tools/make_synthetic_fire.py --out fire_jax/assets/synthetic_fire \
        --tokenizer fire_jax/assets/tiny_tokenizer.json

regenerates the copy shipped in the repo (seed 0, 720 train / 90 test records).
"""

import argparse
import json

from fire_jax.core.cli import input_errors_end_in_one_line, int_at_least
from fire_jax.core.config import InputError
from fire_jax.data.synthetic import corpus, write_synthetic_fire
from fire_jax.data.tokenizer import train_tokenizer


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for train.json, test.json and images/")
    parser.add_argument("--num_train", type=int_at_least(1), default=720)
    parser.add_argument("--num_test", type=int_at_least(1), default=90)
    parser.add_argument("--seed", type=int_at_least(0), default=0)
    parser.add_argument("--tokenizer", help="also train a byte-level BPE on train.json and write it here")
    parser.add_argument("--vocab_size", type=int_at_least(2), default=512, help="tokenizer size; <image> gets the last id")
    args = parser.parse_args()
    paths = write_synthetic_fire(args.out, num_train=args.num_train, num_test=args.num_test, seed=args.seed)
    for split, path in paths.items():
        with open(path, encoding="utf-8") as f:
            print(f"{split}: {len(json.load(f))} records -> {path}")
    if args.tokenizer:
        with open(paths["train"], encoding="utf-8") as f:
            try:
                tokenizer = train_tokenizer(corpus(json.load(f)), vocab_size=args.vocab_size)
            except ValueError as e:  # a vocabulary the corpus and byte alphabet cannot fill exactly
                raise InputError(f"--vocab_size {args.vocab_size}: {e}") from None
        tokenizer.save(args.tokenizer)
        print(f"tokenizer: {tokenizer.get_vocab_size()} tokens, <image> = {tokenizer.token_to_id('<image>')} "
              f"-> {args.tokenizer}")


if __name__ == "__main__":
    input_errors_end_in_one_line("make_synthetic_fire")(main)()
