"""BLEU-1..4 + CIDEr-D: fire_jax.eval.metrics vs pycocoevalcap's scorers on 11,000 pairs.

    python benchmarks/metrics.py [--pairs 11000] [--seed 0] [--repeats 3]

Both sides score the same whitespace-tokenised strings (pycocoevalcap without
its Java PTB tokenizer). Prints seconds (best of --repeats runs), values, the
speed-up over pycocoevalcap, and the largest difference of per-sample scores
(must be <= 1e-9).
"""

import argparse
import pathlib
import sys
import time

import numpy as np
from pycocoevalcap.bleu.bleu import Bleu
from pycocoevalcap.cider.cider import Cider

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from a checkout
from fire_jax.eval import metrics  # noqa: E402

TOLERANCE = 1e-9


def fire_like_pairs(num_pairs: int, seed: int) -> tuple[list[str], list[str]]:
    """Teacher-feedback-like sentences: 20-60 words from a Zipf-weighted 20,000-word
    vocabulary; each prediction edits its reference (keep / substitute / drop / insert)."""
    rng = np.random.default_rng(seed)
    vocab = np.array([f"w{i}" for i in range(20_000)])
    zipf = 1.0 / np.arange(1, len(vocab) + 1)
    zipf /= zipf.sum()
    predictions, references = [], []
    for _ in range(num_pairs):
        reference = rng.choice(vocab, size=rng.integers(20, 61), p=zipf)
        keep = rng.random(len(reference)) < rng.uniform(0.3, 0.9)  # per-pair overlap
        prediction = np.where(keep, reference, rng.choice(vocab, size=len(reference), p=zipf))
        prediction = prediction[rng.random(len(prediction)) > 0.1]
        prediction = np.insert(prediction, rng.integers(0, len(prediction) + 1, size=rng.integers(0, 10)),
                               rng.choice(vocab, p=zipf))
        predictions.append(" ".join(prediction))
        references.append(" ".join(reference))
    return predictions, references


def best_time(fn, repeats: int):
    """(best seconds over `repeats` calls, value): the run least disturbed by other processes."""
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        value = fn()
        seconds.append(time.perf_counter() - start)
    return min(seconds), value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=11_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    predictions, references = fire_like_pairs(args.pairs, args.seed)
    gts = {i: [r] for i, r in enumerate(references)}
    res = {i: [p] for i, p in enumerate(predictions)}
    words_per = [sum(len(t.split()) for t in texts) / args.pairs for texts in (predictions, references)]
    print(f"{args.pairs} pairs, {words_per[0]:.1f} words/prediction, {words_per[1]:.1f} words/reference, "
          f"best of {args.repeats} runs")

    def timed(fn):
        return best_time(fn, args.repeats)

    coco_bleu_s, (_, coco_bleu) = timed(lambda: Bleu(4).compute_score(gts, res, verbose=0))
    coco_cider_s, (_, coco_cider) = timed(lambda: Cider().compute_score(gts, res))
    coco_bleu = np.array(coco_bleu).T  # [pairs, 4]
    ours_bleu_s, ours_bleu = timed(lambda: metrics.bleu_per_sample(predictions, references))
    ours_cider_s, ours_cider = timed(lambda: metrics.cider_per_sample(predictions, references))
    ours_both_s, ours_both = timed(lambda: metrics.text_metrics(predictions, references))
    ours_both = list(ours_both.values())  # BLEU-1..4, CIDEr

    coco_both_s = coco_bleu_s + coco_cider_s
    none4 = [None] * 4
    rows = [  # method, seconds, [BLEU-1..4, CIDEr], pycocoevalcap seconds of the same work
        ("pycocoevalcap Bleu(4)", coco_bleu_s, [*coco_bleu.mean(0), None], coco_bleu_s),
        ("pycocoevalcap Cider", coco_cider_s, [*none4, coco_cider.mean()], coco_cider_s),
        ("pycocoevalcap both", coco_both_s, [*coco_bleu.mean(0), coco_cider.mean()], coco_both_s),
        ("fire_jax bleu_per_sample", ours_bleu_s, [*ours_bleu.mean(0), None], coco_bleu_s),
        ("fire_jax cider_per_sample", ours_cider_s, [*none4, ours_cider.mean()], coco_cider_s),
        ("fire_jax text_metrics (both)", ours_both_s, ours_both, coco_both_s),
    ]
    columns = ["BLEU-1", "BLEU-2", "BLEU-3", "BLEU-4", "CIDEr"]
    header = f"{'method':30s} {'seconds':>8s} " + " ".join(f"{c:>8s}" for c in columns) + "  speed-up"
    print(header)
    print("-" * len(header))
    for name, seconds, values, coco_seconds in rows:
        cells = " ".join("       -" if v is None else f"{v:8.5f}" for v in values)
        print(f"{name:30s} {seconds:8.3f} {cells} {coco_seconds / seconds:8.1f}x")

    differences = {
        "BLEU-1..4 per sample": np.abs(ours_bleu - coco_bleu).max(),
        "CIDEr per sample": np.abs(ours_cider - coco_cider).max(),
        "text_metrics": np.abs(np.array(ours_both) - [*coco_bleu.mean(0), coco_cider.mean()]).max(),
    }
    for name, difference in differences.items():
        print(f"max |fire_jax - pycocoevalcap| {name:22s} {difference:.2e}")
    assert all(d <= TOLERANCE for d in differences.values()), f"values differ by more than {TOLERANCE}"
    print(f"all values equal to {TOLERANCE:g}")


if __name__ == "__main__":
    main()
