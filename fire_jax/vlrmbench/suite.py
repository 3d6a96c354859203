"""A VLRMBench run: the chosen tasks generated, judged, resumed and scored (:mod:`fire_jax.vlrmbench.runner`),
then the paper's further analyses over them (:mod:`fire_jax.vlrmbench.analyses`); ``python -m
fire_jax.evaluate_vlrm`` calls :func:`evaluate`. Above both: an analysis runs tasks through the runner, and a
run ends with the analyses.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from fire_jax.core.results import check_settings
from fire_jax.vlrmbench import analyses as vlrm_analyses
from fire_jax.vlrmbench.data import TaskData, load_task
from fire_jax.vlrmbench.runner import (Responder, _build_judge, judge_name, missing_images, model_name, run_task, score,
                                       select_tasks, task_settings, tiles_needed)
from fire_jax.vlrmbench.tasks import task_info


def evaluate(config, data_dir: str, workdir: str, *, image_root: str | None = None,
             tasks: str | Sequence[str] | None = None, retry_failed: bool = False,
             analyses: str | Sequence[str] | None = None) -> dict:
    """Run, resume and score the chosen VLRMBench tasks; write results.json and results.md in ``workdir``.

    Args:
      config: an ``configs/eval_vlrm.py`` ConfigDict.
      data_dir: folder holding ``<task file>.jsonl`` for every chosen task.
      image_root: the records' image paths are relative to it (default ``data_dir``).
      tasks: overrides ``config.vlrm.tasks``.
      retry_failed: generate again the samples whose records hold a failure.
      analyses: the paper's analyses to run after the tasks ("positional,voting,...";
        :mod:`fire_jax.vlrmbench.analyses`); the tasks they read are added to the run.

    Returns the results.json dict, with the Markdown table under ``"table"`` and
    each analysis's results under ``"analyses"``.
    """
    from tqdm.auto import tqdm

    names = vlrm_analyses.select(analyses)
    files = select_tasks(list(dict.fromkeys(select_tasks(config.vlrm.tasks if tasks is None else tasks)
                                            + vlrm_analyses.tasks_needed(names, config))))
    missing = [f"{f}.jsonl" for f in files if not (Path(data_dir) / f"{f}.jsonl").is_file()]
    if missing:
        raise FileNotFoundError(f"{data_dir}: no {', '.join(missing)}; choose tasks with --tasks")
    workdir_path = Path(workdir)
    (workdir_path / "outputs").mkdir(parents=True, exist_ok=True)

    datasets = {f: load_task(data_dir, f, image_root or data_dir, on_bad_record=config.vlrm.on_bad_record,
                             missing_images=missing_images(config)) for f in files}
    for data in datasets.values():
        print(data.describe())
    for task in files:  # outputs of other settings are never added to a task's JSONL
        check_settings(workdir_path / "settings.json", task_settings(config, task), key=task, where=workdir,
                       outputs=[workdir_path / "outputs" / f"{task}.jsonl"])
    generator = Responder.from_config(config, config.generate, name=model_name(config),
                                      max_new_tokens=config.generate.max_new_tokens)
    _check_tiles(datasets, generator)
    judge = _build_judge(config, generator) if any(task_info(f).theme == "criticism" for f in files) else None
    print(f"model: {generator.name}; ERA/EC judge: {judge_name(config)}; render={config.vlrm.render}, "
          f"parser={config.vlrm.parser}, accounting={config.vlrm.accounting}, missing_images="
          f"{missing_images(config)}; outputs in {workdir_path / 'outputs'}")

    generated = {}
    for f, data in datasets.items():
        generated[f] = run_task(data, generator, judge, workdir_path / "outputs" / f"{f}.jsonl",
                                render=config.vlrm.render, retry_failed=retry_failed)
    tqdm.write(f"generated {sum(generated.values())} samples now, "
               f"{sum(len(d) for d in datasets.values()) - sum(generated.values())} reused from earlier runs")
    for who in dict.fromkeys(g for g in (generator, judge) if getattr(g, "failures", None) is not None):
        tqdm.write(f"{who.backend.description}: failed tries by reason (retried ones included): "
                   f"{dict(who.failures) or 'none'}")
    results = score(datasets, workdir_path, model=generator.name, judge=judge_name(config),
                    parser=config.vlrm.parser, render=config.vlrm.render, accounting=config.vlrm.accounting,
                    missing_images=missing_images(config))
    if names:
        results["analyses"] = vlrm_analyses.run(names, config, datasets, generator, workdir_path)
    return results


def _check_tiles(datasets: dict[str, TaskData], generator: Responder) -> None:
    """Stop before generating when a sample needs more tiles than ``generate.max_tiles``."""
    if not generator.max_tiles:
        return
    for data in datasets.values():
        for sample in data:
            try:
                needed = tiles_needed(sample, generator.geometry)
            except OSError:
                continue  # unreadable: recorded as a failed input when generated
            if needed > generator.max_tiles:
                raise ValueError(f"{data.path}:{sample.line} (id {sample.id}): its {len(sample.images)} image(s) "
                                 f"need {needed} tiles, more than generate.max_tiles={generator.max_tiles}; "
                                 f"raise it, or set 0 to size each batch to its largest sample")
