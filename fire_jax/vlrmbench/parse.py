"""Reading what a model answered: step labels, MJ's two scores, FF's verdict.

``parser="official"`` reads outputs as the release's scripts do (every integer is a label; the last two
integers are the scores; yes/no anywhere). The default ``"robust"`` reads the list the prompt asked for.
Each parser returns what it read and whether it read it; the scorers count the outputs a parser failed on.
"""

from __future__ import annotations

import re
from typing import Iterator

from fire_jax.vlrmbench.tasks import check_choice

PARSERS = ("robust", "official")

# ----------------------------------------------------------------------------
# Parsers. Each returns what it read and whether it read it; a missing output
# (None: the generation failed) is a failure, read as the parser's padding.
# ----------------------------------------------------------------------------

_INTEGER = re.compile(r"\d+")
_BRACKETED = re.compile(r"\[([^\[\]]*)\]")
_PARENTHESISED = re.compile(r"\(([^()]*)\)")
_LABEL_ITEM = re.compile(r"[01]")
_SCORE_ITEM = re.compile(r"(\d+(?:\.\d+)?)(?:\s*/\s*10)?")
# A step's label: 0/1 (not "0.5" or "10"; a full stop after it is fine), a verdict word or a mark.
# "incorrect" before "correct"; "no error" before "error". 1 = the step is erroneous.
_LABEL = (r"(?P<label>[01](?!\d|\.\d)|incorrect\b|not\s+correct\b|wrong\b|erroneous\b|no\s+errors?\b|"
          r"errors?\b|correct\b|right\b|[✓✔✅✗✘❌])")
_ERRONEOUS = re.compile(r"incorrect|not\s+correct|wrong|erroneous|errors?|1|[✗✘❌]", re.IGNORECASE)
_BOLD = r"(?:\*\*|__|\*)?"
# "STEP 3: 1", "**Step 3**: 1.", "step_3 = 0", '{"STEP3": 1}', "| Step 3 | 1 |", "Step 3 - incorrect",
# "Indicator for STEP 3: 0", "STEP 3 -> 1"; (?!\d) keeps "STEP 10" from reading as step 1.
_STEP_PAIR = re.compile(rf"STEP[\s_]*(?P<step>\d+)(?!\d){_BOLD}[\"']?\s*(?:[:=\-–—|]|->|→)\s*{_BOLD}\s*[\"'(]?"
                        + _LABEL, re.IGNORECASE)
# A numbered list or table row of labels: "1. 0", "2) incorrect", "| 3 | 1 |", "**1.** Correct".
_NUMBERED = re.compile(rf"^[ \t>*-]*\|?\s*{_BOLD}(?P<step>\d+)(?!\d)[.):]?{_BOLD}\s*(?:\||:|-|–)?\s*{_BOLD}[\"']?"
                       + _LABEL + r"[\"']?\s*(?:\*\*)?\s*(?:$|[|.,;:!(]|\s[-–(:])", re.IGNORECASE | re.MULTILINE)
# A line that is nothing but labels: "0, 1, 0", "0 1 0", "Answer: 0,1,0".
_BARE_LINE = re.compile(r"^[^\n\d]{0,20}?((?:[01](?:\s*[,;]\s*|\s+))+[01])\s*\.?\s*$", re.MULTILINE)
# "Response 1: 8", "Score for Response 2 = 7/10", "**Response 1**: 8".
_RESPONSE_SCORE = re.compile(r"Response\s*([12])(?!\d)\**\s*[:=]\s*\**\s*(\d+(?:\.\d+)?)", re.IGNORECASE)
_YES_NO = re.compile(r"\b(yes|no|true|false)\b", re.IGNORECASE)


def _bracketed_lists(text: str, item: re.Pattern, pattern: re.Pattern = _BRACKETED) -> list[list[str]]:
    """Every [a, b, ...] in `text` whose items (unquoted, unbolded) all fully match `item`."""
    lists = []
    for body in pattern.findall(text):
        items = [i.strip().strip("\"'*").strip() for i in body.split(",")]
        if all(item.fullmatch(i) for i in items):
            lists.append(items)
    return lists


def _pad(values: list, n: int) -> list:
    return (values + [0] * n)[:n]


def _label_value(word: str) -> int:
    return int(bool(_ERRONEOUS.fullmatch(word.strip())))


def _numbered_labels(pattern: re.Pattern, text: str) -> dict[int, int]:
    """{step: label} from "STEP k: x" pairs or numbered rows; the first label of each step wins."""
    pairs: dict[int, int] = {}
    for match in pattern.finditer(text):
        pairs.setdefault(int(match.group("step")), _label_value(match.group("label")))
    return pairs


def _step_readings(text: str) -> Iterator[list[int] | dict[int, int]]:
    """The ways a text can hold step labels, in order of trust (see try_parse_step_labels)."""
    for pattern in (_BRACKETED, _PARENTHESISED):
        lists = _bracketed_lists(text, _LABEL_ITEM, pattern)
        yield from ([int(i) for i in items] for items in reversed(lists))  # the last list first
    yield _numbered_labels(_STEP_PAIR, text)
    yield _numbered_labels(_NUMBERED, text)
    for line in reversed(_BARE_LINE.findall(text)):
        yield [int(i) for i in re.findall(r"[01]", line)]


def try_parse_step_labels(text: str | None, num_steps: int, parser: str = "robust") -> tuple[list[int], bool]:
    """Per-step labels (1 = erroneous) read from a step-task output, and whether reading succeeded.

    official (the release's ``utils.format_model_answer_tolist``): every
    integer in the text is a label, values > 1 become 1, the first
    `num_steps` are kept, missing ones are 0; a text with fewer integers than
    steps counts as a parse failure (the official accounting scores it
    padded, as the release does). It reads "STEP 1: 0, STEP 2: 1" as
    [1, 0, 1, 1] and counts a restated "[Indicator for STEP 1, ...]".
    robust (default): the readings of :func:`_step_readings`, in order --
    bracketed 0/1 lists (last first), then parenthesised ones, "STEP k: x"
    pairs, numbered rows ("1. 0", "| 1 | 1 |"), lines of bare labels -- where
    a label is 0/1 (a full stop after it is fine), a verdict word
    ("incorrect", "wrong", "error" = 1; "correct", "right", "no error" = 0)
    or a check mark. The first reading with exactly `num_steps` labels (a
    list) or a label for every step 1..num_steps and no other (pairs, rows)
    wins; else the first non-empty reading, padded with 0 or cut, and the
    parse counts as a failure. Every form it reads is in tests/test_vlrmbench.py.
    """
    check_choice(parser, PARSERS, "parser")
    if text is None:
        return [0] * num_steps, False
    if parser == "official":
        labels = [min(int(i), 1) for i in _INTEGER.findall(text)]
        return _pad(labels, num_steps), len(labels) >= num_steps
    fallback = None
    for reading in _step_readings(text):
        if isinstance(reading, dict):
            complete = set(reading) == set(range(1, num_steps + 1))
            labels = [reading.get(k, 0) for k in range(1, num_steps + 1)]
        else:
            complete, labels = len(reading) == num_steps, _pad(reading, num_steps)
        if complete:
            return labels, True
        if reading and fallback is None:
            fallback = labels
    return (fallback or [0] * num_steps), False


def parse_step_labels(text: str | None, num_steps: int, parser: str = "robust") -> list[int]:
    """Per-step labels read from a step-task output; see try_parse_step_labels."""
    return try_parse_step_labels(text, num_steps, parser)[0]


def try_parse_scores(text: str | None, parser: str = "robust") -> tuple[tuple[float, float], bool]:
    """The two scores (response 1, response 2) of an MJ or judge output, and whether reading succeeded.

    official (the release's ``utils.format_ms_ec_era_model_answer_tolist``):
    the last two integers, padded with 0 when fewer (a parse failure then);
    '["8", "6"] Response 1 is better.' reads as (6, 1).
    robust (default): the last bracketed list of exactly two numbers (quotes
    and "/10" allowed), else "Response 1: x ... Response 2: y"; (0, 0) when
    neither is there.
    """
    check_choice(parser, PARSERS, "parser")
    if text is None:
        return (0.0, 0.0), False
    if parser == "official":
        numbers = [float(i) for i in _INTEGER.findall(text)]
        ok = len(numbers) >= 2
        first, second = numbers[-2:] if ok else _pad(numbers, 2)
        return (first, second), ok
    lists = [items for items in _bracketed_lists(text, _SCORE_ITEM) if len(items) == 2]
    if lists:
        first, second = (float(_SCORE_ITEM.fullmatch(i).group(1)) for i in lists[-1])
        return (first, second), True
    scores: dict[str, float] = {}
    for response, score in _RESPONSE_SCORE.findall(text):
        scores.setdefault(response, float(score))
    if set(scores) == {"1", "2"}:
        return (scores["1"], scores["2"]), True
    return (0.0, 0.0), False


def parse_scores(text: str | None, parser: str = "robust") -> tuple[float, float]:
    """The two scores of an MJ or judge output; see try_parse_scores."""
    return try_parse_scores(text, parser)[0]


def parse_foresight(text: str | None, parser: str = "robust") -> frozenset[bool]:
    """The answers an FF output is read as giving (True = "yes"); empty = failed to read.

    official (the release): True if yes/true appears anywhere as a word,
    False if no/false does, so "I think yes, but no" gives {True, False} and
    is scored correct whatever the label. robust (default): only the first
    yes/no/true/false word.
    """
    check_choice(parser, PARSERS, "parser")
    words = [] if text is None else [w.lower() for w in _YES_NO.findall(text)]
    if parser == "robust":
        words = words[:1]
    return frozenset(w in ("yes", "true") for w in words)


