"""The teacher's score a_i and the feedback text the student is shown, read from a feedback f_i."""

from __future__ import annotations

import re

_SCORE_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")

#: How a score is read from a feedback text (:func:`parse_score`): "robust" (default) or "official" (the release's).
SCORE_PARSERS = ("robust", "official")
_RELEASE_SCORE = re.compile(r"\d+")


def parse_score(feedback: str, parser: str = "robust") -> float | None:
    """The score a_i of a feedback text (docs/spec.md, "Records and scores").

    robust (default): the first number (integer or decimal) on the first line
    that contains "Score:"; no such line, or a number outside 0..10, gives
    None. "Score: 8/10." gives 8, "Score: 7.5" gives 7.5.

    official: the release's ``get_score`` (MM-FIRE/FIRE,
    ``llava/eval/feedback_chat.py``): the text's first line must contain
    "Score:" and the first run of digits on it (``re.findall(r"\\d+", ...)[0]``)
    is the score, with no range check; else None. "Score: 7.5" gives 7,
    "Score: 11" gives 11, "Score: -2" gives 2, a score line after another
    line gives None. What the release's evaluations add to it (a "Feedback:"
    the fixed dialogues need, a failure read as 0 that stops a free dialogue)
    is in :mod:`fire_jax.eval.fixed` and :class:`fire_jax.dialogue.stop.StopRule`.
    """
    if parser == "official":
        lines = feedback.splitlines()
        numbers = _RELEASE_SCORE.findall(lines[0]) if lines and "Score:" in lines[0] else []
        return int(numbers[0]) if numbers else None
    if parser != "robust":
        raise ValueError(f"score parser must be one of {list(SCORE_PARSERS)}, got {parser!r}")
    for line in feedback.splitlines():
        if "Score:" in line:
            match = _SCORE_NUMBER.search(line)
            if match is None:
                return None
            value = float(match.group())
            if not 0 <= value <= 10:
                return None
            return int(value) if value.is_integer() else value
    return None


def feedback_text(feedback: str) -> str:
    """The part of a feedback shown to the student: what follows "Feedback:".

    Without a "Feedback:" marker, the feedback minus its score line.
    """
    head, marker, tail = feedback.partition("Feedback:")
    if marker:
        return tail.strip()
    return "\n".join(line for line in feedback.splitlines() if "Score:" not in line).strip()
