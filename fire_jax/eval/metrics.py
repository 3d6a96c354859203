"""Text and dialogue metrics of the FIRE evaluation (FIRE Tables 2-6, Fig. 7; formulas in docs/spec.md).

Pure functions of plain Python/numpy data: no model, no jax.

Fixed dialogues (FIRE Tables 2-3): BLEU-1..4 and CIDEr-D, bit-for-bit the
algorithms of pycocoevalcap's `Bleu(4)` and `Cider()` scorers on whitespace
tokens with one reference per prediction, but vectorised with numpy (n-grams are
interned to integer ids once and counted with sorts instead of per-sentence
dicts), and the teacher's score MAE.

Free dialogues (FIRE Tables 4-6, Fig. 7): average turns AT, average
difference ADR, average turn-normalised difference ATR, refinement ratio RR and
the accuracy-by-turn curve, from the teacher scores a_{k,1..n_k} of each item.
"""

import dataclasses
import itertools
import math
import numbers
import re
from collections.abc import Sequence

import numpy as np

MAX_NGRAM = 4  # BLEU-1..4 and CIDEr-D both use n-grams up to 4
CIDER_SIGMA = 6.0  # std of CIDEr-D's gaussian length penalty
# pycocoevalcap's bleu_scorer guards: `tiny` in numerators so that 0 matches
# gives ~0, `small` in denominators so that 0 guesses do not divide by zero.
BLEU_TINY = 1e-15
BLEU_SMALL = 1e-9
_KEY_LIMIT = 2 ** 63  # sort keys are int64


# ----------------------------------------------------------------------------
# n-gram counts shared by BLEU and CIDEr


@dataclasses.dataclass(frozen=True)
class _OrderCounts:
    """Counts of the k-grams of every prediction and reference, for one order k.

    One entry per distinct (k-gram, pair, side); entries are sorted by
    (gram, pair, side), so a k-gram present in both the prediction and the
    reference of a pair is a prediction entry directly followed by its
    reference entry.
    """

    pair: np.ndarray  # [entries] int64, index of the prediction/reference pair
    is_ref: np.ndarray  # [entries] bool, False: prediction, True: reference
    gram: np.ndarray  # [entries] int64, global id of the k-gram
    count: np.ndarray  # [entries] float64, occurrences in that sentence
    shared: np.ndarray  # [matches] int64, prediction entries whose k-gram the reference also has
    num_grams: int  # distinct k-grams over all sentences


@dataclasses.dataclass(frozen=True)
class _PairNgrams:
    num_pairs: int
    prediction_len: np.ndarray  # [num_pairs] int64, whitespace tokens
    reference_len: np.ndarray  # [num_pairs] int64
    orders: list[_OrderCounts]  # orders[k - 1] holds the k-grams


def _check_pairs(predictions: Sequence[str], references: Sequence[str]) -> None:
    for name, texts in (("predictions", predictions), ("references", references)):
        if isinstance(texts, str):
            raise ValueError(f"{name} must be a sequence of strings, got one string")
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise ValueError(f"{name}[{i}] is {type(text).__name__}, expected str "
                                 "(one reference string per prediction)")
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions but {len(references)} references; "
                         "expected one reference per prediction")
    if not predictions:
        raise ValueError("no predictions to score")


def _pair_ngrams(predictions: Sequence[str], references: Sequence[str]) -> _PairNgrams:
    """Interns the 1..4-grams of every sentence and counts them per sentence.

    One sort per order k of the int64 key (k-gram, pair, side) over all
    tokens; a k-gram is the pair of compact ids of its two halves, so only the
    2-grams need compact ids beyond the token ids.
    """
    _check_pairs(predictions, references)
    num_pairs = len(predictions)
    num_sentences = 2 * num_pairs  # predictions first, then references
    sentences = [text.split() for text in predictions] + [text.split() for text in references]
    lengths = np.fromiter(map(len, sentences), dtype=np.int64, count=num_sentences)
    words = list(itertools.chain.from_iterable(sentences))
    vocab = dict(zip(dict.fromkeys(words), itertools.count()))
    token = np.fromiter(map(vocab.__getitem__, words), dtype=np.int64, count=len(words))  # [tokens]
    sentence = np.repeat(np.arange(num_sentences, dtype=np.int64), lengths)  # [tokens]
    side_code = ((sentence % num_pairs) << 1) | (sentence >= num_pairs)  # [tokens], 2 * pair + is_ref
    side_bits = max(1, (num_sentences - 1).bit_length())
    tokens_left = np.repeat(np.cumsum(lengths), lengths) - np.arange(len(words))  # [tokens], >= 1

    orders = []
    # gram_ids[j]: [tokens] compact id of the j-gram starting at each token (-1 past the sentence end).
    gram_ids, num_gram_ids = {1: token}, {1: len(vocab)}
    for k in range(1, MAX_NGRAM + 1):
        starts = np.flatnonzero(tokens_left >= k)
        half = k // 2
        gram_key = (token[starts] if k == 1 else
                    gram_ids[half][starts] * num_gram_ids[k - half] + gram_ids[k - half][starts + half])
        if len(starts) and (int(gram_key.max()) + 1) << side_bits >= _KEY_LIMIT:
            gram_key = np.unique(gram_key, return_inverse=True)[1]  # compact first, so the key fits
        key = (gram_key << side_bits) | side_code[starts]
        needs_ids = 1 < k <= (MAX_NGRAM + 1) // 2  # a half of a longer n-gram
        if needs_ids:
            uniq, inverse, count = np.unique(key, return_inverse=True, return_counts=True)
        else:
            uniq, count = np.unique(key, return_counts=True)
        entry_gram_key = uniq >> side_bits
        new_gram = np.ones(len(uniq), dtype=bool)
        new_gram[1:] = entry_gram_key[1:] != entry_gram_key[:-1]
        entry_gram = np.cumsum(new_gram) - 1
        entry_side = uniq & ((1 << side_bits) - 1)
        orders.append(_OrderCounts(
            pair=entry_side >> 1,
            is_ref=(entry_side & 1).astype(bool),
            gram=entry_gram,
            count=count.astype(np.float64),
            # uniq >> 1 holds (gram_key, pair): equal for a pair's prediction and reference entries.
            shared=np.flatnonzero((uniq[1:] >> 1) == (uniq[:-1] >> 1)),
            num_grams=int(new_gram.sum()),
        ))
        if needs_ids:
            gram_ids[k] = np.full_like(token, -1)
            gram_ids[k][starts] = entry_gram[inverse]
            num_gram_ids[k] = orders[-1].num_grams
    return _PairNgrams(num_pairs, lengths[:num_pairs], lengths[num_pairs:], orders)


# ----------------------------------------------------------------------------
# BLEU


def _bleu_per_sample(ngrams: _PairNgrams) -> np.ndarray:
    """[num_pairs, 4] per-sentence BLEU-1..4, as pycocoevalcap's `scores`."""
    n = len(ngrams.orders)
    correct, guess = _bleu_counts(ngrams)  # [num_pairs, n] each
    precision = (correct + BLEU_TINY) / (guess + BLEU_SMALL)
    bleu = np.cumprod(precision, axis=1) ** (1.0 / np.arange(1, n + 1))
    return bleu * _brevity_penalty(ngrams.prediction_len, ngrams.reference_len)[:, None]


def _bleu_counts(ngrams: _PairNgrams) -> tuple[np.ndarray, np.ndarray]:
    """Clipped k-gram matches and k-gram counts of each prediction, [num_pairs, n] each."""
    correct = np.stack([
        np.bincount(counts.pair[counts.shared],
                    weights=np.minimum(counts.count[counts.shared], counts.count[counts.shared + 1]),
                    minlength=ngrams.num_pairs)
        for counts in ngrams.orders], axis=1)
    k = np.arange(1, len(ngrams.orders) + 1)
    guess = np.maximum(0, ngrams.prediction_len[:, None] - k + 1).astype(np.float64)
    return correct, guess


def _brevity_penalty(prediction_len, reference_len) -> np.ndarray:
    # With one reference, option="closest" picks that reference's length.
    ratio = (np.asarray(prediction_len) + BLEU_TINY) / (np.asarray(reference_len) + BLEU_SMALL)
    return np.where(ratio < 1, np.exp(1 - 1 / ratio), 1.0)


def bleu_per_sample(predictions: Sequence[str], references: Sequence[str]) -> np.ndarray:
    """Per-sentence BLEU-1..4, [num_pairs, 4] (fixed dialogues, FIRE Tables 2-3).

    BLEU-n = BP * (prod_{k<=n} (c_k + 1e-15) / (g_k + 1e-9))^(1/n) with c_k the
    clipped k-gram matches, g_k the prediction's k-gram count and the brevity
    penalty BP = exp(1 - r/c) when c < r (c, r: prediction and reference
    lengths, +1e-15 and +1e-9): pycocoevalcap's `BleuScorer.compute_score(
    option="closest")` per-sentence `scores`, on whitespace tokens
    (Papineni et al. 2002, section 2.3, applied per sentence). An empty
    prediction scores 0.
    """
    return _bleu_per_sample(_pair_ngrams(predictions, references))


def bleu(predictions: Sequence[str], references: Sequence[str]) -> list[float]:
    """[BLEU-1, ..., BLEU-4]: the mean over pairs of `bleu_per_sample`."""
    return [float(v) for v in bleu_per_sample(predictions, references).mean(axis=0)]


def _cider_per_sample(ngrams: _PairNgrams) -> np.ndarray:
    """[num_pairs] CIDEr-D, as pycocoevalcap's `CiderScorer.compute_score` scores."""
    num_pairs = ngrams.num_pairs
    # log(1..num_pairs) from one table, so that an n-gram in every reference
    # gets idf log(N) - log(N) = 0 exactly, as in pycocoevalcap.
    log_count = np.log(np.arange(1, num_pairs + 1, dtype=np.float64))
    log_num_refs = log_count[-1]
    # pycocoevalcap's "length" is a sentence's bigram count, max(0, words - 1):
    # the same differences as word counts unless a sentence is empty, and a
    # pair with an empty sentence scores 0 either way.
    delta = (ngrams.prediction_len - ngrams.reference_len).astype(np.float64)
    length_penalty = np.e ** (-(delta ** 2) / (2 * CIDER_SIGMA ** 2))
    similarity = []
    for counts in ngrams.orders:
        doc_freq = np.bincount(counts.gram[counts.is_ref], minlength=counts.num_grams)
        idf = log_num_refs - log_count[np.maximum(doc_freq, 1) - 1]
        tf_idf = counts.count * idf[counts.gram]  # [entries]
        norm = np.sqrt(np.bincount(2 * counts.pair + counts.is_ref, weights=tf_idf ** 2,
                                   minlength=2 * num_pairs)).reshape(num_pairs, 2)
        hyp, ref = tf_idf[counts.shared], tf_idf[counts.shared + 1]
        dot = np.bincount(counts.pair[counts.shared], weights=np.minimum(hyp, ref) * ref,
                          minlength=num_pairs)
        norms = norm[:, 0] * norm[:, 1]  # 0 only where a side has no weighted n-gram, and then dot = 0
        cosine = np.divide(dot, norms, out=np.zeros(num_pairs), where=norms != 0)
        similarity.append(cosine * length_penalty)
    return np.mean(np.stack(similarity, axis=1), axis=1) * 10.0


def cider_per_sample(predictions: Sequence[str], references: Sequence[str]) -> np.ndarray:
    """Per-sample CIDEr-D, [num_pairs] (Vedantam et al. 2015, eq. 2-4 with CIDEr-D's changes).

    CIDEr-D_n = 10 * g^T min(g_hyp, g_ref) / (|g_hyp| |g_ref|) * exp(-(l_hyp -
    l_ref)^2 / (2 sigma^2)) with tf-idf vectors g over n-grams (tf: raw counts,
    idf = log(N) - log(max(1, df)), df counted over the N evaluated references),
    sigma = 6 and the score the mean over n = 1..4. As pycocoevalcap's
    `Cider().compute_score`; l is the number of words (pycocoevalcap counts
    bigrams, which differs only where a sentence is empty and the score is 0).
    """
    return _cider_per_sample(_pair_ngrams(predictions, references))


def cider(predictions: Sequence[str], references: Sequence[str]) -> float:
    """CIDEr-D of the corpus: the mean of `cider_per_sample`."""
    return float(np.mean(cider_per_sample(predictions, references)))


def text_metrics(predictions: Sequence[str], references: Sequence[str]) -> dict[str, float]:
    """{"BLEU-1".."BLEU-4", "CIDEr"} of `bleu` and `cider`, counting n-grams once."""
    ngrams = _pair_ngrams(predictions, references)
    metrics = {f"BLEU-{k}": float(v)
               for k, v in enumerate(_bleu_per_sample(ngrams).mean(axis=0), start=1)}
    metrics["CIDEr"] = float(np.mean(_cider_per_sample(ngrams)))
    return metrics


# ----------------------------------------------------------------------------
# Teacher score MAE


def score_mae(predicted_scores: Sequence[float | None], reference_scores: Sequence[float],
              missing_penalty: float = 10.0) -> float:
    """Teacher MAE = (1/K) sum_k |a_k - â_k| (fixed dialogues, FIRE Table 3).

    A predicted score of None (the teacher's reply had no score) costs
    `missing_penalty` instead of |a_k - â_k|.
    """
    if len(predicted_scores) != len(reference_scores):
        raise ValueError(f"{len(predicted_scores)} predicted scores but "
                         f"{len(reference_scores)} reference scores")
    if not reference_scores:
        raise ValueError("no scores to compare")
    errors = []
    for k, (predicted, reference) in enumerate(zip(predicted_scores, reference_scores)):
        _check_score(reference, f"reference_scores[{k}]")
        if predicted is None:
            errors.append(missing_penalty)
        else:
            _check_score(predicted, f"predicted_scores[{k}]")
            errors.append(abs(predicted - reference))
    return float(np.mean(errors))


# ----------------------------------------------------------------------------
# Free dialogues


def _check_score(score, where: str) -> None:
    if isinstance(score, bool) or not isinstance(score, numbers.Real) or not math.isfinite(score):
        raise ValueError(f"{where} is {score!r}, expected a finite number")


def _dialogue_scores(score_sequences: Sequence[Sequence[float | None]], max_turns: int) -> list[list[float]]:
    """Validated scores a_{k,1..n_k} per item, a missing score (None) read as 0."""
    dialogues = []
    for k, scores in enumerate(score_sequences):
        if isinstance(scores, (str, bytes)) or not isinstance(scores, Sequence):
            raise ValueError(f"item {k}: expected a sequence of scores, got {type(scores).__name__}")
        if not scores:
            raise ValueError(f"item {k}: empty score sequence; every dialogue has at least one turn")
        if len(scores) > max_turns:
            raise ValueError(f"item {k}: {len(scores)} scores, more than max_turns={max_turns}")
        for t, score in enumerate(scores[:-1]):
            if score is None:
                raise ValueError(f"item {k}: turn {t + 1} has no score (None) but is not the last; "
                                 "a teacher reply with no score ends the dialogue")
            _check_score(score, f"item {k}, turn {t + 1}")
        if scores[-1] is not None:
            _check_score(scores[-1], f"item {k}, turn {len(scores)}")
        dialogues.append([float(score) for score in scores[:-1]] +
                         [0.0 if scores[-1] is None else float(scores[-1])])
    return dialogues


def free_dialogue_metrics(score_sequences: Sequence[Sequence[float | None]],
                          baseline_turns: float | None = None, *, threshold: float,
                          max_turns: int = 5, penalty_turns: float = 10) -> dict[str, float]:
    """AT, ADR, ATR, RR of free dialogues (FIRE Tables 4-6).

    ``threshold``: the stop rule's (:class:`fire_jax.dialogue.stop.StopRule`, 8 in the paper), passed by the
    caller so that the metrics count as solved what stopped the dialogues.

    `score_sequences[k]` holds the teacher scores a_{k,1..n_k}; a None (reply
    with no score) must be the last and counts as 0. Items with n_k = 1 are
    removed; over the remaining K:
      t_k = n_k if a_{k,n_k} >= threshold else penalty_turns (p = 10),
      mean_turns = (1/K) sum t_k,  AT = mean_turns / baseline_turns,
      ADR = (1/K) sum (a_{k,n_k} - a_{k,1}),
      ATR = (1/K) sum (a_{k,n_k} - a_{k,1}) / (n_k - 1),
      RR  = (1/K) sum [a_{k,n_k} >= threshold] - [a_{k,1} >= threshold].
    `baseline_turns` is the baseline model's `mean_turns` on its own run; when
    None, AT is normalised by this run's own mean_turns, i.e. AT = 1.0.
    With K = 0 every metric is NaN and "K" is 0. Whether each dialogue stopped
    by the protocol (solved, non-increasing score, max_turns) is not checked.
    """
    if baseline_turns is not None and not (math.isfinite(baseline_turns) and baseline_turns > 0):
        raise ValueError(f"baseline_turns is {baseline_turns!r}, expected a positive number")
    refined = [scores for scores in _dialogue_scores(score_sequences, max_turns) if len(scores) > 1]
    if not refined:
        return {"AT": math.nan, "ADR": math.nan, "ATR": math.nan, "RR": math.nan,
                "K": 0, "mean_turns": math.nan}
    first = np.array([scores[0] for scores in refined])  # [K]
    last = np.array([scores[-1] for scores in refined])  # [K]
    num_turns = np.array([len(scores) for scores in refined])  # [K]
    mean_turns = float(np.mean(np.where(last >= threshold, num_turns, penalty_turns)))
    return {
        "AT": mean_turns / (mean_turns if baseline_turns is None else baseline_turns),
        "ADR": float(np.mean(last - first)),
        "ATR": float(np.mean((last - first) / (num_turns - 1))),
        "RR": float(np.mean((last >= threshold).astype(float) - (first >= threshold))),
        "K": len(refined),
        "mean_turns": mean_turns,
    }


def accuracy_by_turn(score_sequences: Sequence[Sequence[float | None]], max_turns: int = 5, *,
                     threshold: float) -> list[float]:
    """Accuracy curve (FIRE Fig. 7): for t = 1..max_turns, the share of all
    items (n_k = 1 included) whose score at turn min(t, n_k) is >= threshold; a
    finished dialogue keeps its final score for later turns, a None counts as 0.
    With no items every entry is NaN.
    """
    dialogues = _dialogue_scores(score_sequences, max_turns)
    if not dialogues:
        return [math.nan] * max_turns
    return [float(np.mean([scores[min(t, len(scores)) - 1] >= threshold for scores in dialogues]))
            for t in range(1, max_turns + 1)]


# ---------------------------------------------------------------------------- single-turn VQA (Table 1)
# The forgetting check of the paper's Table 1: VQAv2's answer normalisation and soft accuracy (the official
# vqaEval.py of the VQA API), and exact match for multiple-choice benchmarks.

_VQA_CONTRACTIONS = {
    "aint": "ain't", "arent": "aren't", "cant": "can't", "couldve": "could've", "couldnt": "couldn't",
    "couldn'tve": "couldn't've", "couldnt've": "couldn't've", "didnt": "didn't", "doesnt": "doesn't",
    "dont": "don't", "hadnt": "hadn't", "hadnt've": "hadn't've", "hadn'tve": "hadn't've", "hasnt": "hasn't",
    "havent": "haven't", "hed": "he'd", "hed've": "he'd've", "he'dve": "he'd've", "hes": "he's", "howd": "how'd",
    "howll": "how'll", "hows": "how's", "Id've": "I'd've", "I'dve": "I'd've", "Im": "I'm", "Ive": "I've",
    "isnt": "isn't", "itd": "it'd", "itd've": "it'd've", "it'dve": "it'd've", "itll": "it'll", "let's": "let's",
    "maam": "ma'am", "mightnt": "mightn't", "mightnt've": "mightn't've", "mightn'tve": "mightn't've",
    "mightve": "might've", "mustnt": "mustn't", "mustve": "must've", "neednt": "needn't", "notve": "not've",
    "oclock": "o'clock", "oughtnt": "oughtn't", "ow's'at": "'ow's'at", "'ows'at": "'ow's'at", "'ow'sat": "'ow's'at",
    "shant": "shan't", "shed've": "she'd've", "she'dve": "she'd've", "she's": "she's", "shouldve": "should've",
    "shouldnt": "shouldn't", "shouldnt've": "shouldn't've", "shouldn'tve": "shouldn't've", "somebody'd": "somebodyd",
    "somebodyd've": "somebody'd've", "somebody'dve": "somebody'd've", "somebodyll": "somebody'll",
    "somebodys": "somebody's", "someoned": "someone'd", "someoned've": "someone'd've", "someone'dve": "someone'd've",
    "someonell": "someone'll", "someones": "someone's", "somethingd": "something'd",
    "somethingd've": "something'd've", "something'dve": "something'd've", "somethingll": "something'll",
    "thats": "that's", "thered": "there'd", "thered've": "there'd've", "there'dve": "there'd've",
    "therere": "there're", "theres": "there's", "theyd": "they'd", "theyd've": "they'd've", "they'dve": "they'd've",
    "theyll": "they'll", "theyre": "they're", "theyve": "they've", "twas": "'twas", "wasnt": "wasn't",
    "wed've": "we'd've", "we'dve": "we'd've", "weve": "we've", "werent": "weren't", "whatll": "what'll",
    "whatre": "what're", "whats": "what's", "whatve": "what've", "whens": "when's", "whered": "where'd",
    "wheres": "where's", "whereve": "where've", "whod": "who'd", "whod've": "who'd've", "who'dve": "who'd've",
    "wholl": "who'll", "whos": "who's", "whove": "who've", "whyll": "why'll", "whyre": "why're", "whys": "why's",
    "wont": "won't", "wouldve": "would've", "wouldnt": "wouldn't", "wouldnt've": "wouldn't've",
    "wouldn'tve": "wouldn't've", "yall": "y'all", "yall'll": "y'all'll", "y'allll": "y'all'll",
    "yall'd've": "y'all'd've", "y'alld've": "y'all'd've", "y'all'dve": "y'all'd've", "youd": "you'd",
    "youd've": "you'd've", "you'dve": "you'd've", "youll": "you'll", "youre": "you're", "youve": "you've",
}
_VQA_NUMBERS = {"none": "0", "zero": "0", "one": "1", "two": "2", "three": "3", "four": "4", "five": "5",
                "six": "6", "seven": "7", "eight": "8", "nine": "9", "ten": "10"}
_VQA_ARTICLES = ("a", "an", "the")
_VQA_PUNCT = (";", "/", "[", "]", '"', "{", "}", "(", ")", "=", "+", "\\", "_", "-", ">", "<", "@", "`", ",", "?",
              "!")
_VQA_PERIOD = re.compile(r"(?!<=\d)(\.)(?!\d)")  # the official pattern, look-behind typo included
_VQA_COMMA = re.compile(r"(\d)(,)(\d)")


def vqa_normalize(answer: str) -> str:
    """VQAv2's answer normalisation: punctuation, periods not in numbers, lower case, number words to digits,
    articles dropped, contractions restored (vqaEval.py's processPunctuation + processDigitArticle)."""
    text = answer.replace("\n", " ").replace("\t", " ").strip()
    out = text
    for p in _VQA_PUNCT:
        if (p + " " in text or " " + p in text) or _VQA_COMMA.search(text) is not None:
            out = out.replace(p, "")
        else:
            out = out.replace(p, " ")
    out = _VQA_PERIOD.sub("", out)
    words = [_VQA_NUMBERS.get(w, w) for w in out.lower().split()]
    words = [_VQA_CONTRACTIONS.get(w, w) for w in words if w not in _VQA_ARTICLES]
    return " ".join(words)


def vqa_accuracy(prediction: str, answers: Sequence[str]) -> float:
    """VQAv2 soft accuracy of one prediction against its human answers (10 in VQAv2).

    For each answer left out in turn, min(1, #matches among the other answers / 3); the mean over the
    answers ("10 choose 9"). Both sides normalised by :func:`vqa_normalize` (the official script skips
    the answers' normalisation when all of them agree; normalising always changes nothing then unless
    the agreed answer itself is unnormalised, where it is the fairer reading).
    E.g. "two" against three "2" and seven "3": "two" -> "2" matches 3; left out, a "2" leaves 2 matches
    (2/3) and a "3" leaves 3 (1), so (3 x 2/3 + 7 x 1) / 10 = 0.9; "3" scores 1.0, "4" 0.0. With a single
    reference answer it is exact match after normalisation (the leave-one-out rule would always give 0).
    """
    if not answers:
        raise ValueError("vqa_accuracy: no reference answers")
    truth = [vqa_normalize(a) for a in answers]
    predicted = vqa_normalize(prediction)
    if len(truth) == 1:  # one reference (GQA, TextVQA-style files): exact match after normalisation
        return float(predicted == truth[0])
    matches = sum(t == predicted for t in truth)
    return float(np.mean([min(1.0, (matches - (t == predicted)) / 3.0) for t in truth]))


_CHOICE_LETTER = re.compile(r"^\(?([A-Z])(?:[.):]|\s|$)")


def multiple_choice_accuracy(prediction: str, answer: str, choices: Sequence[str]) -> float:
    """Exact match for multiple choice (ScienceQA-IMG, MMBench): 1.0 when the prediction names the right option,
    by its letter ("B", "(B)", "B. text") or by its whole text (case and surrounding space ignored).

    ``answer`` is the right option's letter or its text; ``choices`` are the option texts, lettered A, B, ...
    """
    letters = [chr(ord("A") + i) for i in range(len(choices))]
    norm = lambda s: " ".join(s.strip().rstrip(".").lower().split())
    right = answer.strip().upper() if answer.strip().upper() in letters else None
    if right is None:
        by_text = [letter for letter, choice in zip(letters, choices) if norm(choice) == norm(answer)]
        if not by_text:
            raise ValueError(f"multiple_choice_accuracy: answer {answer!r} is neither a letter nor one of {choices}")
        right = by_text[0]
    text = prediction.strip()
    match = _CHOICE_LETTER.match(text)
    if match and match.group(1) in letters:
        return float(match.group(1) == right)
    named = [letter for letter, choice in zip(letters, choices) if norm(choice) == norm(text)]
    return float(named == [right])
