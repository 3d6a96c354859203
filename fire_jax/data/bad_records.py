"""Records that cannot be used: the error that names file, record and field, and the counts by reason.

Readers of every kind (FIRE and instruction records, triplets, VLRMBench records, batch prompts) raise
:class:`BadRecordError`; bulk jobs skip and count them by reason (:class:`BadRecords`), or stop on the first
under ``on_bad_record="error"`` (:meth:`BadRecords.handle`, the one skip-or-raise rule).
"""

from __future__ import annotations

import collections

from fire_jax.core.config import InputError

# Reasons a record is skipped at parse time: invalid_json, invalid_utf8, oversize_field, missing_field,
# missing_image, image_outside_root, unreadable_image, bad_turn_order, empty_text, and no_score where scores are
# required (the teacher's data, the evaluations); the pipeline adds image_cut, no_labelled_token (and no_score for
# a teacher reading a built split).


class BadRecordError(InputError):
    """A record that cannot be used, under ``on_bad_record="error"``."""

    def __init__(self, reason: str, where: str, field: str, detail: str = ""):
        self.reason, self.where, self.field = reason, where, field
        super().__init__(f"{where}: field {field!r}: {reason}" + (f" ({detail})" if detail else ""))


class BadRecords(collections.Counter):
    """Counts of skipped records by reason, with the first offender of each reason."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.first: dict[str, str] = {}

    def add(self, error: BadRecordError) -> None:
        self[error.reason] += 1
        self.first.setdefault(error.reason, str(error))

    def handle(self, error: BadRecordError, on_bad_record: str) -> None:
        """The one skip-or-raise rule: raise ``error`` under ``on_bad_record="error"``, else count it."""
        if on_bad_record == "error":
            raise error
        if on_bad_record != "skip":
            raise ValueError(f"on_bad_record must be 'skip' or 'error', got {on_bad_record!r}")
        self.add(error)

    def merge(self, other: "BadRecords") -> None:
        self.update(other)
        for reason, example in getattr(other, "first", {}).items():
            self.first.setdefault(reason, example)

    def report(self, title: str = "bad records") -> str:
        if not self:
            return f"{title}: none"
        lines = [f"{title}: {sum(self.values())}"]
        for reason, count in sorted(self.items()):
            example = self.first.get(reason)
            lines.append(f"  {reason:<18} {count:>8}" + (f"   e.g. {example}" if example else ""))
        return "\n".join(lines)
