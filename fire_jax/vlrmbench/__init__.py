"""VLRMBench (Ruan et al., 2025): a model judged as a vision-language reward model (docs/vlrmbench.md).

The model-independent half is plain Python and numpy:

- :mod:`~fire_jax.vlrmbench.tasks`: the twelve tasks, a benchmark record (``Sample``), the release's prompts
  (package data, ``prompts.json``) and the prompts built from a sample;
- :mod:`~fire_jax.vlrmbench.data`: one task's JSONL read into samples, bad records counted by reason;
- :mod:`~fire_jax.vlrmbench.parse`: what a model answered, read by the robust or the release's parser;
- :mod:`~fire_jax.vlrmbench.score`: the metrics, scoring, and the table beside the paper's rows.

The model half: :mod:`~fire_jax.vlrmbench.runner` (one task generated with a fire_jax model or an endpoint,
resumable, then scored), :mod:`~fire_jax.vlrmbench.analyses` (the paper's further analyses),
:mod:`~fire_jax.vlrmbench.suite` (a whole run: the tasks, then the analyses; ``python -m
fire_jax.evaluate_vlrm``) and :mod:`~fire_jax.vlrmbench.audit` (what the labels alone predict).

Two switches keep the release's behaviour available for comparable numbers: ``render="official"`` fills
``{ai_respond_1}`` (MJ) and FF's reasoning process with ``str(step_list)`` as the release does (default
``"plain"``: "STEP1: ...\nSTEP2: ..." text, so the good solution does not give itself away by its format),
and ``parser="official"`` (see :mod:`~fire_jax.vlrmbench.parse`).
"""

from fire_jax.vlrmbench.tasks import (  # noqa: F401
    Sample, TaskInfo, TASKS, task_info, TASK_PROMPTS, JUDGE_PROMPTS, RENDERS, check_choice, render_steps, reasoning_process, num_orders, build_prompt, build_judge_prompt)
from fire_jax.vlrmbench.data import (  # noqa: F401
    count_steps, BadRecord, TaskData, load_task)
from fire_jax.vlrmbench.parse import (  # noqa: F401
    PARSERS, try_parse_step_labels, parse_step_labels, try_parse_scores, parse_scores, parse_foresight)
from fire_jax.vlrmbench.score import (  # noqa: F401
    ACCOUNTINGS, FAILURE_REASONS, PAPER_RESULTS, PAPER_MODELS, PAPER_JUDGE, f1_per_class, weighted_f1, weighted_average, TaskResult, score_task, score_accountings, theme_average, pooled_step_f1, step_counts, weighted_f1_of_counts, VLMEVALKIT_FAIL_MSG, load_paper_results, results_table)
