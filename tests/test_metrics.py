"""fire_jax.eval.metrics: parity with pycocoevalcap and hand-computed dialogue metrics."""

import math
import random

import numpy as np
import pytest
from pycocoevalcap.bleu.bleu import Bleu
from pycocoevalcap.cider.cider import Cider

from fire_jax.eval import metrics

TOL = 1e-9


def assert_close(actual, expected):
    np.testing.assert_allclose(actual, expected, rtol=0, atol=TOL)


def random_pairs(seed: int, num_pairs: int) -> tuple[list[str], list[str]]:
    """Sentences over a tiny vocabulary: heavy overlap, repeated words, empty and one-word sentences."""
    rng = random.Random(seed)
    vocab = ["the", "cat", "sat", "on", "a", "mat", "red", "is", "answer", "9"]
    lengths = [0, 1, 1, 2, 3, 4, 5, 8, 13, 21]

    def sentence() -> str:
        kind = rng.random()
        if kind < 0.1:
            return " ".join([rng.choice(vocab)] * rng.choice(lengths))  # one word repeated
        return " ".join(rng.choice(vocab) for _ in range(rng.choice(lengths)))

    references = [sentence() for _ in range(num_pairs)]
    predictions = []
    for reference in references:
        if rng.random() < 0.3:  # a noisy copy of the reference, so that high-order n-grams match
            words = reference.split()
            predictions.append(" ".join(w if rng.random() < 0.8 else rng.choice(vocab) for w in words))
        else:
            predictions.append(sentence())
    predictions[0] = ""  # always an empty prediction
    return predictions, references


def coco_scores(predictions, references):
    gts = {i: [r] for i, r in enumerate(references)}
    res = {i: [p] for i, p in enumerate(predictions)}
    corpus, per_sentence = Bleu(4).compute_score(gts, res, verbose=0)
    _, cider_scores = Cider().compute_score(gts, res)
    return np.array(corpus), np.array(per_sentence).T, np.array(cider_scores)


@pytest.mark.parametrize("seed,num_pairs", [(0, 2), (1, 3), (2, 17), (3, 200), (4, 1000)])
def test_bleu_and_cider_equal_pycocoevalcap(seed, num_pairs):
    predictions, references = random_pairs(seed, num_pairs)
    _, per_sentence, cider_scores = coco_scores(predictions, references)  # the corpus BLEU: no metric of ours

    assert_close(metrics.bleu_per_sample(predictions, references), per_sentence)
    assert_close(metrics.bleu(predictions, references), per_sentence.mean(axis=0))
    assert_close(metrics.cider_per_sample(predictions, references), cider_scores)
    assert metrics.cider(predictions, references) == pytest.approx(cider_scores.mean(), abs=TOL)
    combined = metrics.text_metrics(predictions, references)
    assert list(combined) == ["BLEU-1", "BLEU-2", "BLEU-3", "BLEU-4", "CIDEr"]
    assert_close(list(combined.values()), [*per_sentence.mean(axis=0), cider_scores.mean()])
    if num_pairs >= 200:  # the larger sets do exercise high-order matches and high CIDEr
        assert cider_scores.max() > 1.0 and per_sentence[:, 3].max() > 0.5


def test_large_vocabulary_key_compaction(monkeypatch):
    # Keys of (k-gram, pair, side) that would not fit int64 are compacted first; force that path.
    monkeypatch.setattr(metrics, "_KEY_LIMIT", 2 ** 16)
    predictions, references = random_pairs(5, 300)
    _, per_sentence, cider_scores = coco_scores(predictions, references)
    assert_close(metrics.bleu_per_sample(predictions, references), per_sentence)
    assert_close(metrics.cider_per_sample(predictions, references), cider_scores)


def test_ngram_in_every_reference_has_zero_idf():
    # "a" is in both references: idf = log(2) - log(2) must be exactly 0, as in pycocoevalcap;
    # otherwise the first pair's unigram cosine would be ~1e-32 / ~1e-32 instead of 0.
    predictions, references = ["a a", "a b c"], ["a", "a b"]
    _, per_sentence, cider_scores = coco_scores(predictions, references)
    assert_close(metrics.cider_per_sample(predictions, references), cider_scores)
    assert_close(metrics.bleu_per_sample(predictions, references), per_sentence)


def test_bleu_hand_computed():
    # 4 of 4 unigrams, 3/3 bigrams, 2/2 trigrams, 1/1 4-gram match; brevity penalty exp(1 - 5/4).
    scores = metrics.bleu_per_sample(["a b c d"], ["a b c d e"])
    assert_close(scores, [[math.exp(-0.25)] * 4])
    # Clipping: "a a a a" against "a b" matches one "a"; no bigram matches (1e-15 / 3 floor).
    scores = metrics.bleu_per_sample(["a a a a"], ["a b"])
    assert scores[0, 0] == pytest.approx(0.25, abs=1e-9)
    assert scores[0, 1] == pytest.approx(math.sqrt(0.25 * 1e-15 / 3), rel=1e-6)
    # An empty prediction scores 0; "x" vs "x" has 0 of 0 k-grams for k > 1, each a 1e-15 / 1e-9 factor.
    assert metrics.bleu(["", "x"], ["x", "x"]) == pytest.approx(
        [0.5, 0.5 * 1e-6 ** (1 / 2), 0.5 * 1e-12 ** (1 / 3), 0.5 * 1e-18 ** (1 / 4)], rel=1e-6)


def test_cider_single_pair_is_zero():
    # With one reference every reference n-gram has idf log(1) - log(1) = 0.
    assert metrics.cider(["a b c"], ["a b c"]) == 0.0


def test_text_metric_errors():
    with pytest.raises(ValueError, match="2 predictions but 1 references"):
        metrics.bleu(["a", "b"], ["a"])
    with pytest.raises(ValueError, match=r"references\[1\] is list"):
        metrics.cider(["a", "b"], ["a", ["b"]])
    with pytest.raises(ValueError, match="no predictions"):
        metrics.bleu([], [])


def test_score_mae():
    assert metrics.score_mae([7, None, 3], [9, 5, 3]) == pytest.approx((2 + 10 + 0) / 3)
    assert metrics.score_mae([7.5, None], [9, 5], missing_penalty=4.0) == pytest.approx((1.5 + 4) / 2)
    with pytest.raises(ValueError, match=r"reference_scores\[0\]"):
        metrics.score_mae([1], [None])
    with pytest.raises(ValueError, match="2 predicted scores but 1"):
        metrics.score_mae([1, 2], [1])


# Every branch of the free-dialogue protocol, threshold 8 (the stop rule passes its own), p = 10.
T = 8
DIALOGUES = [
    [9],                # solved at turn 1: n_k = 1, removed from AT/ADR/ATR/RR
    [4, 6, 9],          # solved at turn 3: t = 3, diff 5, per turn 2.5, RR +1
    [5, 5],             # stopped on a non-increasing score: t = 10, diff 0
    [2, 3, 4, 5, 6],    # never solved in 5 turns: t = 10, diff 4, per turn 1
    [6, None],          # teacher gave no score: a = 0, t = 10, diff -6, per turn -6
    [3],                # unsolved at turn 1: n_k = 1, removed
]


def test_free_dialogue_metrics_by_hand():
    result = metrics.free_dialogue_metrics(DIALOGUES, threshold=T)
    assert result["K"] == 4
    assert result["mean_turns"] == pytest.approx((3 + 10 + 10 + 10) / 4)
    assert result["AT"] == pytest.approx(1.0)  # normalised by its own mean_turns
    assert result["ADR"] == pytest.approx((5 + 0 + 4 - 6) / 4)
    assert result["ATR"] == pytest.approx((2.5 + 0 + 1 - 6) / 4)
    assert result["RR"] == pytest.approx(1 / 4)


def test_free_dialogue_metrics_baseline_normalisation():
    baseline = metrics.free_dialogue_metrics([[7, 8], [6, 7]], threshold=T)  # t = 2 and 10
    assert baseline["mean_turns"] == pytest.approx(6.0)
    result = metrics.free_dialogue_metrics(DIALOGUES, baseline_turns=baseline["mean_turns"], threshold=T)
    assert result["AT"] == pytest.approx(8.25 / 6.0)
    # A first answer already >= 8 that is kept lowers RR.
    assert metrics.free_dialogue_metrics([[8, 9], [9, 7]], threshold=T)["RR"] == pytest.approx((0 - 1) / 2)


def test_free_dialogue_metrics_no_refined_items():
    result = metrics.free_dialogue_metrics([[9], [None]], baseline_turns=5.0, threshold=T)
    assert result["K"] == 0
    assert all(math.isnan(result[key]) for key in ["AT", "ADR", "ATR", "RR", "mean_turns"])


@pytest.mark.parametrize("sequences,message", [
    ([[5, 6], []], "item 1: empty"),
    ([[1, 2, 3, 4, 5, 6]], "item 0: 6 scores, more than max_turns=5"),
    ([[5], [None, 7]], "item 1: turn 1 has no score"),
    ([[5, "7"]], "item 0, turn 2 is '7'"),
    ([[5, float("nan")]], "item 0, turn 2 is nan"),
])
def test_dialogue_input_errors(sequences, message):
    with pytest.raises(ValueError, match=message):
        metrics.free_dialogue_metrics(sequences, threshold=T)
    with pytest.raises(ValueError, match=message):
        metrics.accuracy_by_turn(sequences, threshold=T)


def test_bad_baseline_turns():
    with pytest.raises(ValueError, match="baseline_turns"):
        metrics.free_dialogue_metrics(DIALOGUES, baseline_turns=0, threshold=T)


def test_accuracy_by_turn():
    # Turn 1: only [9]; turn 2: [9] kept ([6, None] reads 0); turn 3 on: [9] and [4, 6, 9].
    assert metrics.accuracy_by_turn(DIALOGUES, threshold=T) == pytest.approx([1 / 6, 1 / 6, 2 / 6, 2 / 6, 2 / 6])
    assert metrics.accuracy_by_turn([[7, 8]], max_turns=3, threshold=T) == [0.0, 1.0, 1.0]
    assert metrics.accuracy_by_turn([[7, 8]], max_turns=3, threshold=10) == [0.0, 0.0, 0.0]  # the rule's, not 8
    assert all(math.isnan(v) for v in metrics.accuracy_by_turn([], threshold=T))


# ---------------------------------------------------------------------------- VQA (Table 1)


def test_vqa_accuracy_hand_computed():
    from fire_jax.eval.metrics import vqa_accuracy

    answers = ["2"] * 3 + ["3"] * 7
    assert vqa_accuracy("two", answers) == pytest.approx(0.9)  # 3 x 2/3 + 7 x 1, over 10
    assert vqa_accuracy("3", answers) == 1.0 and vqa_accuracy("4", answers) == 0.0
    assert vqa_accuracy("2", ["2"] * 2 + ["x"] * 8) == pytest.approx((2 * 1 / 3 + 8 * 2 / 3) / 10)  # 0.6
    # Normalisation: case, articles, punctuation, contractions, number words, periods outside numbers.
    assert vqa_accuracy("The Dog.", ["dog"] * 10) == 1.0
    assert vqa_accuracy("Isnt it?", ["isn't it"] * 10) == 1.0
    assert vqa_accuracy("3.5", ["3.5"] * 10) == 1.0 and vqa_accuracy("35", ["3.5"] * 10) == 0.0
    assert vqa_accuracy("1,000", ["1000"] * 10) == 1.0
    assert vqa_accuracy("red-car", ["red car"] * 10) == 1.0
    assert vqa_accuracy("Red.", ["red"]) == 1.0 and vqa_accuracy("blue", ["red"]) == 0.0  # one reference
    with pytest.raises(ValueError):
        vqa_accuracy("x", [])


def test_vqa_normalize_matches_the_official_rules():
    from fire_jax.eval.metrics import vqa_normalize

    assert vqa_normalize("  A Red-Car!\n") == "red car"
    assert vqa_normalize("dont know, the answer") == "don't know answer"
    assert vqa_normalize("one two three zero none") == "1 2 3 0 0"
    assert vqa_normalize("end. 2.5") == "end 2.5"


def test_multiple_choice_exact_match():
    from fire_jax.eval.metrics import multiple_choice_accuracy

    choices = ["red", "blue", "green"]
    for prediction in ("B", "(B)", "B.", "B. blue", "blue", " Blue. "):
        assert multiple_choice_accuracy(prediction, "B", choices) == 1.0, prediction
        assert multiple_choice_accuracy(prediction, "blue", choices) == 1.0, prediction
    for prediction in ("A", "red", "C) green", "blue or green", ""):
        assert multiple_choice_accuracy(prediction, "B", choices) == 0.0, prediction
    with pytest.raises(ValueError):
        multiple_choice_accuracy("A", "purple", choices)
