"""When a dialogue stops: the stop rule of free dialogues (FIRE-Bench, Tables 4-6) and of FIRE-1M-style generation
(Fig. 3b), and how it reads the teacher's score.

After turn k, with teacher scores a_1..a_k, :func:`stop_reason` decides whether the dialogue goes on:

- a_k is None (the teacher's reply has no score): stop, ``"no_score"`` (counts as 0);
- a_k >= threshold (8): stop, ``"solved"``;
- a_k = 0 with the release's score reading (``score_parser="official"``): stop, ``"zero_score"``;
- k > 1 and a_k <= a_{k-1}: stop, ``"no_increase"`` (free dialogues only);
- k = max_turns (5; 3 for generation): stop, ``"max_turns"``.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from fire_jax.data.scores import SCORE_PARSERS, parse_score


@dataclasses.dataclass(frozen=True)
class StopRule:
    """When a dialogue ends (solved, no score increase, or the turn limit: docs/spec.md), and how it reads the teacher's score.

    ``score_parser``: "robust" keeps the score the teacher agent read
    (:func:`fire_jax.data.scores.parse_score`'s default); "official" reads
    each reply as the release's free-dialogue loader does (MM-FIRE/FIRE,
    ``llava/eval/model_fire_chat_loader.py``): ``get_score`` (a failure is
    its score 0, here None), and a dialogue whose last score is 0 stops
    (``CustomDataset`` drops an item whose last score is >= 8 or == 0, or
    not above the one before, from the next round).

    The one owner of the stop threshold: the dialogue loop, the metrics (AT, RR, the accuracy curve), the
    exact judge's "the teacher says right" (:meth:`solves`), and every report, plot label and analysis read it
    from the rule they ran with. A free-dialogue config section sets every field (:meth:`from_config`;
    docs/fire_bench.md, "Settings"). The rule of the release's interactive chat (MM-FIRE/FIRE,
    ``llava/eval/feedback_chat.py``: ``Chat.chat`` runs ``num_round=3`` rounds and ``should_stop`` ends only on
    a score of 10) is ``StopRule(max_turns=3, threshold=10, stop_on_no_increase=False)``, in a config
    ``free.max_turns=3, free.threshold=10.0, free.stop_on_no_increase=False``.
    """

    max_turns: int = 5  # n_max
    threshold: float = 8.0  # a score >= threshold solves the item
    stop_on_no_increase: bool = True  # stop when a_k <= a_{k-1}
    score_parser: str = "robust"  # or "official" (above)

    @classmethod
    def from_config(cls, section) -> "StopRule":
        """The rule of a free-dialogue config section (``config.free``): each of this class's fields the section
        names, the defaults for the others; the section's other settings (``penalty_turns``, ...) are not the
        rule's."""
        return cls(**{field.name: section[field.name] for field in dataclasses.fields(cls) if field.name in section})

    def __post_init__(self):
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")
        if self.score_parser not in SCORE_PARSERS:
            raise ValueError(f"score_parser must be one of {list(SCORE_PARSERS)}, got {self.score_parser!r}")

    def solves(self, score: float | None) -> bool:
        """a_k solves the item (a score >= :attr:`threshold`; no score never does): the dialogue stops as
        ``"solved"``, the metrics count the item as solved, the exact judge reads it as the teacher saying
        "right"."""
        return score is not None and score >= self.threshold

    def score(self, feedback) -> float | None:
        """a_k of a teacher's reply (``feedback.text``, ``feedback.score``) under this rule's reading."""
        return feedback.score if self.score_parser == "robust" else parse_score(feedback.text, self.score_parser)


FREE_DIALOGUE = StopRule()  # free dialogues (Tables 4-6)
FIRE_1M_GENERATION = StopRule(max_turns=3, stop_on_no_increase=False)  # FIRE-1M-style data (Fig. 3b)
STOP_REASONS = ("no_score", "solved", "zero_score", "no_increase", "max_turns")


def stop_reason(scores: Sequence[float | None], rule: StopRule = FREE_DIALOGUE) -> str | None:
    """Why the dialogue with teacher scores a_1..a_k stops after turn k, or None if it goes on."""
    score = scores[-1]
    if score is None:
        return "no_score"
    if rule.solves(score):
        return "solved"
    if rule.score_parser == "official" and score == 0:
        return "zero_score"
    if rule.stop_on_no_increase and len(scores) > 1 and score <= scores[-2]:
        return "no_increase"
    if len(scores) >= rule.max_turns:
        return "max_turns"
    return None
