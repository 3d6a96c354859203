"""PNG figures: accuracy by turn (Fig. 7) and the data statistics of a FIRE split (Fig. 5).

Matplotlib with the Agg backend (no display needed).
"""

from __future__ import annotations

import collections
from typing import Mapping, Sequence

import numpy as np

from fire_jax.core.files import save_figure
from fire_jax.data.records import Conversation


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def score_sequences(records: Sequence) -> list[list[float]]:
    """Scores a_1..a_n per dialogue of FIRE conversations, free-dialogue records ({"scores": [...]}) or
    plain score lists; a missing score (a teacher reply without one) counts as 0."""
    out = []
    for record in records:
        if isinstance(record, Conversation):
            scores = [turn.score for turn in record.turns]
        elif isinstance(record, Mapping):
            scores = record["scores"]
        else:
            scores = record
        out.append([0.0 if s is None else float(s) for s in scores])
    return out


def data_statistics(records: Sequence) -> dict:
    """The numbers of Fig. 5 for some dialogues (see :func:`score_sequences` for what ``records`` may be).

    - ``first_score``: counts of a_1 in bins 0, 1, ..., 10 (a decimal score goes to the nearest bin, .5 up);
    - ``score_gain``: {k: mean of a_k - a_{k-1} over dialogues with >= k turns} for k >= 2, with ``gain_count``;
    - ``turns``: {n: number of dialogues with n turns}.
    """
    scores = [s for s in score_sequences(records) if s]
    first = np.floor(np.array([s[0] for s in scores], dtype=float) + 0.5).astype(int)
    longest = max((len(s) for s in scores), default=0)
    gains = {k: [s[k - 1] - s[k - 2] for s in scores if len(s) >= k] for k in range(2, longest + 1)}
    return {
        "dialogues": len(scores),
        "first_score": np.bincount(np.clip(first, 0, 10), minlength=11).tolist(),
        "score_gain": {k: float(np.mean(v)) for k, v in gains.items()},
        "gain_count": {k: len(v) for k, v in gains.items()},
        "turns": dict(sorted(collections.Counter(len(s) for s in scores).items())),
    }


def plot_data_statistics(records: Sequence, out_path: str, title: str = "") -> dict:
    """Fig. 5 for any FIRE records: first-turn score distribution, mean score gain per turn, turns per
    dialogue; writes a PNG to ``out_path`` and returns :func:`data_statistics`."""
    stats = data_statistics(records)
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    axes[0].bar(range(11), stats["first_score"], color="tab:blue")
    axes[0].set(xlabel="score of the first turn", ylabel="dialogues", xticks=range(11),
                title="first-turn score distribution")
    turns = sorted(stats["score_gain"])
    axes[1].bar(turns, [stats["score_gain"][k] for k in turns], width=0.6, color="tab:green")
    for k in turns:
        axes[1].annotate(f"n={stats['gain_count'][k]}", (k, stats["score_gain"][k]), ha="center", va="bottom",
                         fontsize=8)
    axes[1].set(xlabel="turn k", ylabel="mean $a_k - a_{k-1}$", xticks=turns, title="score gain per turn")
    axes[2].bar(list(stats["turns"]), list(stats["turns"].values()), width=0.6, color="tab:orange")
    axes[2].set(xlabel="turns", ylabel="dialogues", xticks=list(stats["turns"]), title="turns per dialogue")
    fig.suptitle(title or f"{stats['dialogues']} dialogues")
    fig.tight_layout()
    save_figure(fig, out_path, dpi=120)
    plt.close(fig)
    return stats


def plot_accuracy_by_turn(curves: Mapping[str, Sequence[float]], out_path: str,
                          paper: Mapping[str, Mapping[str, float]] | None = None, title: str = "") -> None:
    """Fig. 7: share of items (%) solved by turn (a score >= their stop rule's threshold), one line per run in
    ``curves`` (fractions), plus the paper's quoted points (``figure7_accuracy_by_turn`` of fire.json:
    {"turn1": %, "turn5": %})."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for name, curve in curves.items():
        ax.plot(range(1, len(curve) + 1), [float("nan") if a is None else 100 * a for a in curve], marker="o",
                label=name)
    for name, points in (paper or {}).items():
        if not isinstance(points, Mapping):
            continue
        turns = sorted(int(key[len("turn"):]) for key in points)
        ax.plot(turns, [points[f"turn{t}"] for t in turns], linestyle=":", marker="s", label=f"{name} (paper)")
    longest = max([len(c) for c in curves.values()] + [5])
    ax.set(xlabel="turn", ylabel="accuracy (%)", xticks=range(1, longest + 1), title=title or "accuracy by turn")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, out_path, dpi=120)
    plt.close(fig)


def plot_data_size_ablation(points: Sequence[Mapping], out_path: str, title: str = "") -> None:
    """Fig. 6: AT, ADR, ATR and RR (four panels) against the number of training dialogues.

    ``points``: one mapping per trained student with ``size`` and the four metrics.
    """
    plt = _pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(13, 3.2))
    sizes = [p["size"] for p in points]
    for ax, metric in zip(axes, ("AT", "ADR", "ATR", "RR")):
        values = [p.get(metric) for p in points]
        ax.plot(sizes, [float("nan") if v is None else v for v in values], marker="o")
        ax.set(xlabel="training dialogues", title=metric)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    save_figure(fig, out_path, dpi=120)
    plt.close(fig)
