"""How command-line tools end on bad input: one line naming the file, record, field and reason, exit 2.

A traceback is for bugs; a missing file, a JSON file that does not parse, a record
without its question, a config typo or a split in which every record is bad is the
user's input, and the tool says so in one line on stderr::

    build_dataset: error: no usable record in split 'fire_100k' of ['bad.json']: 3 bad records skipped
    (missing_field: 2, invalid_json: 1; e.g. bad.json: record 0: field 'question': missing_field)

``FIRE_JAX_TRACEBACK=1`` shows the traceback instead.
"""

from __future__ import annotations

import functools
import json
import os
import sys

from fire_jax.config import InputError


#: What a CLI reports in one line (:class:`fire_jax.data.records.BadRecordError` is an InputError).
INPUT_ERRORS = (InputError, FileNotFoundError, IsADirectoryError, json.JSONDecodeError)


def one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def input_errors_end_in_one_line(prog: str):
    """Decorate a CLI's main: input errors (:class:`InputError`, bad records, missing files, invalid JSON)
    print ``<prog>: error: <what and where>`` on stderr and exit 2."""

    def wrap(main):
        @functools.wraps(main)
        def guarded(*args, **kwargs):
            try:
                return main(*args, **kwargs)
            except INPUT_ERRORS as error:
                if os.environ.get("FIRE_JAX_TRACEBACK"):
                    raise
                print(f"{prog}: error: {one_line(error)}", file=sys.stderr)
                sys.exit(2)

        return guarded

    return wrap
