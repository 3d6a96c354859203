"""fire_jax.core.results: the one JSONL store, settings guard and strict-JSON writer every resumable job uses."""

import json
import math

import pytest

from fire_jax.data.bad_records import BadRecordError, BadRecords
from fire_jax.core.results import ResultStore, check_settings, finite, write_json


def test_store_cuts_a_partial_last_line_and_the_last_line_of_a_key_wins(tmp_path):
    path = tmp_path / "out" / "store.jsonl"
    with ResultStore(path, "id") as store:
        assert len(store) == 0 and not store.cut
        store.add({"id": "a", "v": 1})
        store.add_many([{"id": "b", "v": 2}, {"id": "a", "v": 3}])
    with open(path, "a") as f:
        f.write('{"id": "c", "v"')  # killed while writing
    assert ResultStore.read(path, "id") == {"a": {"id": "a", "v": 3}, "b": {"id": "b", "v": 2}}
    assert path.read_text().endswith('"v"')  # reading does not touch the file
    store = ResultStore(path, "id")
    assert store.cut and sorted(store.records) == ["a", "b"] and store["a"]["v"] == 3 and "c" not in store
    assert path.read_text().endswith("\n") and len(path.read_text().splitlines()) == 3
    store.add({"id": "c", "v": 4})
    store.close()
    assert [json.loads(line)["id"] for line in path.read_text().splitlines()] == ["a", "b", "a", "c"]


def test_store_unreadable_line_stops_or_is_counted(tmp_path):
    path = tmp_path / "store.jsonl"
    path.write_text('{"key": "x"}\nnot json\n{"other": 1}\n')
    with pytest.raises(ValueError, match=r"store.jsonl: line 2 is not a result record"):
        ResultStore(path)
    store = ResultStore(path, unreadable="skip")
    assert (sorted(store.records), store.unreadable) == (["x"], 2)
    with pytest.raises(ValueError, match="unreadable must be"):
        ResultStore(path, unreadable="ignore")
    assert ResultStore.read(tmp_path / "missing.jsonl") == {} and not (tmp_path / "missing.jsonl").exists()
    ResultStore(tmp_path / "empty.jsonl").close()  # a writer with nothing to write still leaves its (empty) file
    assert (tmp_path / "empty.jsonl").read_text() == ""


def test_check_settings_whole_file_and_per_key(tmp_path):
    path = tmp_path / "settings.json"
    check_settings(path, {"seed": 0, "shape": (1, 2)})
    check_settings(path, {"seed": 0, "shape": [1, 2]})  # tuples are compared as JSON reads them back
    with pytest.raises(ValueError, match=r"its outputs were generated with other settings \(seed: 0 -> 1\)"):
        check_settings(path, {"seed": 1, "shape": [1, 2]})
    check_settings(path, {"seed": 1}, outputs=[tmp_path / "none.jsonl"])  # nothing made yet: the new ones recorded
    assert json.loads(path.read_text()) == {"seed": 1}

    per_task = tmp_path / "w" / "settings.json"
    check_settings(per_task, {"render": "plain"}, key="SC")
    check_settings(per_task, {"render": "plain"}, key="MJ")
    with pytest.raises(ValueError, match=r"w: the outputs of SC were generated with other settings \(render: "
                                         r"'plain' -> 'official'\)"):
        check_settings(per_task, {"render": "official"}, key="SC")
    (tmp_path / "SC.jsonl").write_text("")
    check_settings(per_task, {"render": "official"}, key="SC", outputs=[tmp_path / "SC.jsonl"])  # an empty file
    assert json.loads(per_task.read_text()) == {"SC": {"render": "official"}, "MJ": {"render": "plain"}}
    (tmp_path / "SC.jsonl").write_text('{"id": 1}\n')  # outputs of those settings: they bind again
    with pytest.raises(ValueError, match=r"render: 'official' -> 'plain'"):
        check_settings(per_task, {"render": "plain"}, key="SC", outputs=[tmp_path / "SC.jsonl"])


def test_finite_json(tmp_path):
    value = {"a": math.nan, 1: [math.inf, 2.5, (-math.inf, "x")], "b": {"c": 0.0}}
    assert finite(value) == {"a": None, "1": [None, 2.5, [None, "x"]], "b": {"c": 0.0}}
    written = write_json(tmp_path / "r.json", value)
    assert json.loads((tmp_path / "r.json").read_text()) == written


def test_bad_records_handle_is_the_one_skip_or_raise_rule():
    bad = BadRecords()
    error = BadRecordError("missing_field", "f.json: record 3", "question")
    bad.handle(error, "skip")
    bad.handle(BadRecordError("missing_field", "f.json: record 4", "question"), "skip")
    assert bad == {"missing_field": 2} and bad.first["missing_field"] == "f.json: record 3: field 'question': missing_field"
    with pytest.raises(BadRecordError, match="record 3"):
        bad.handle(error, "error")
    with pytest.raises(ValueError, match="on_bad_record must be"):
        bad.handle(error, "ignore")
    assert sum(bad.values()) == 2


def test_a_cut_last_line_is_reported_and_a_bad_byte_named(tmp_path, capsys):
    path = tmp_path / "store.jsonl"
    path.write_bytes(b'{"id": "a", "v": 1}\n{"id": "b", "v"')
    assert ResultStore.read(path, "id") == {"a": {"id": "a", "v": 1}}
    assert capsys.readouterr().err.strip() == f"{path}: line 2 was cut short (15 bytes, a run stopped while " \
                                              "writing it): not read"
    store = ResultStore(path, "id")
    assert store.cut and store.cut_line == b'{"id": "b", "v"' and path.read_bytes() == b'{"id": "a", "v": 1}\n'
    assert capsys.readouterr().err.strip() == f"{path}: line 2 was cut short (15 bytes, a run stopped while " \
                                              "writing it): dropped, its unit runs again"
    store.close()
    # A whole record written without its newline is a record, not a cut: kept, the newline added.
    path.write_bytes(b'{"id": "a", "v": 1}\n{"id": "b", "v": 2}')
    with ResultStore(path, "id") as store:
        assert sorted(store.records) == ["a", "b"] and not store.cut
    assert path.read_bytes().endswith(b"2}\n") and capsys.readouterr().err == ""
    # A byte that is not UTF-8 names the file and line; skipped, it is counted and said.
    path.write_bytes(b'{"id": "a"}\n{"id": "b", "v": "\xff"}\n{"id": "c"}\n')
    with pytest.raises(ValueError, match=r"store.jsonl: line 2 is not a result record \(byte 19 of the line is "
                                         r"not UTF-8\)") as e:
        ResultStore(path, "id")
    from fire_jax.core.config import InputError

    assert isinstance(e.value, InputError)
    capsys.readouterr()
    store = ResultStore(path, "id", unreadable="skip")
    assert sorted(store.records) == ["a", "c"] and store.unreadable == 1
    assert capsys.readouterr().err.strip() == (f"{path}: 1 line(s) that are not result records skipped (first: "
                                               "line 2: byte 19 of the line is not UTF-8)")
    store.close()
    # U+2028 inside a string (written as is: ensure_ascii=False) is not a line break.
    with ResultStore(tmp_path / "sep.jsonl", "id") as store:
        store.add({"id": "x", "text": "a\u2028b"})
    assert ResultStore.read(tmp_path / "sep.jsonl", "id") == {"x": {"id": "x", "text": "a\u2028b"}}


def test_settings_file_that_is_not_json_names_the_file(tmp_path):
    from fire_jax.core.config import InputError

    path = tmp_path / "settings.json"
    path.write_text("{broken")
    with pytest.raises(InputError, match=r"settings.json: not valid JSON: Expecting property name"):
        check_settings(path, {"a": 1})
    path.write_text('{"a": "cut')
    with pytest.raises(InputError) as e:
        check_settings(path, {"a": 1})
    assert str(e.value) == f"{path}: not valid JSON: Unterminated string starting at line 1 column 7"


def test_a_store_write_that_fails_names_the_file_and_the_space_left(tmp_path, monkeypatch):
    """An evaluation's results on a full disk: one WriteFailed naming the store's file (a CLI ends on its line);
    the file keeps its whole lines (on a real full disk: tests/test_failures.py)."""
    import errno
    import os

    from fire_jax.core import results
    from fire_jax.core.config import WriteFailed

    store = ResultStore(tmp_path / "outputs.jsonl")
    store.add({"key": "kept"})

    def full(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(results.os, "write", full)
    with pytest.raises(WriteFailed) as e:
        store.add({"key": "a"})
    assert open(tmp_path / "outputs.jsonl").read() == '{"key": "kept"}\n'
    assert str(e.value).startswith(f"could not write {tmp_path / 'outputs.jsonl'}: No space left on device (")
    assert str(e.value).endswith(" on its filesystem)") and " free of " in str(e.value)
