"""Label-leak audit of VLRMBench step-task files: what rules that read no meaning score.

    python tools/audit_vlrmbench.py DIR/step_correctness.jsonl DIR/location_error.jsonl ... --json OUT.json

Reads official VLRMBench step-task files (SC, RD, CM, EH, AH, DE, SR, IC; the
task is the file's name, or --task for one file named otherwise), prints per
file a table of the paper's inverse-weighted F1 for the trivial baselines
all_0 / all_1 and each surface rule (fire_jax/vlrmbench/audit.py lists them),
and writes OUT.json as {"<file name>": {"all_0": F1, "all_1": F1, "rules":
{"<rule>": F1, ...}}}. Bad records are skipped and counted by reason.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fire_jax.core.cli import input_errors_end_in_one_line  # noqa: E402
from fire_jax.vlrmbench.audit import audit_file, audit_json, audit_report  # noqa: E402


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", help="VLRMBench step-task JSONL files")
    parser.add_argument("--json", help="write the audit here")
    parser.add_argument("--task", help="the task of every file (short or file name; default: each file's name)")
    args = parser.parse_args(argv)
    for path in args.files:
        if not Path(path).is_file():
            parser.error(f"argument files: {path!r} is not a file")
    if args.task is not None:
        from fire_jax.vlrmbench.tasks import task_info

        try:
            task_info(args.task)
        except ValueError as e:
            parser.error(f"argument --task: {e}")
    audits = {}
    for path in args.files:
        try:
            audit, data = audit_file(path, args.task)
        except ValueError as e:
            if "unknown VLRMBench task" not in str(e):
                raise
            parser.error(f"{path}: {e}; name the task with --task")
        name = Path(path).name
        audits[name] = audit
        print(audit_report(name, audit, data))
    out = audit_json(audits)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.json}")
    return out


if __name__ == "__main__":
    input_errors_end_in_one_line("audit_vlrmbench")(main)()
