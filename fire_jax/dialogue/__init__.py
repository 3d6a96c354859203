"""FIRE's dialogues, over the inference layer's backends: the student / teacher agents and the exact teacher
(``agents``), when a dialogue stops (``stop``), the dialogue loop and its results file (``loop``), and the data
generated from dialogues, FIRE-1M-style (``fire1m``) and FIRE-100K-style (``fire100k``)."""

from fire_jax.dialogue.agents import Feedback, Student, Teacher

__all__ = ["Feedback", "Student", "Teacher"]
