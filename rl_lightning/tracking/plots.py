"""Pictures of a run: PNG figures in ``plots/`` of the run's folder, also logged to its MLflow run.

One figure per question, plus ``summary.png`` with all of them:

- RL (PPO, GRPO, DAPO...): ``reward.png`` (the training reward and its components per rollout, the held-out reward
  as points), ``heldout.png`` (the held-out reward by component and by named validation set: e.g. the share of
  correct answers), ``completion_length.png``, ``entropy.png``, ``kl.png``; with ``data.curriculum``,
  ``curriculum.png`` (pool sizes and how many seen prompts fall in each pass-rate bin, per rollout);
- SFT: ``loss.png``; DPO and the reward model: ``loss.png``, ``accuracy.png``, ``margin.png``.

Lines are the values logged per step (optimizer step, or rollout for RL); dashed lines with dots are the validation
points, the one at 0 the starting model's where the task scores it. A long noisy series (20 points or more) is drawn
faint with its trailing mean over a tenth of the run on top. The data is the MLflow run's metric history read at the
end (`rl_lightning.tracking.history`: a resumed run's history includes the part before the resume). A panel with
nothing to draw is left out (no KL panel for a run without a KL term whose updates stay on-policy), and so are the
reward components the run weighs 0 (``reward_weights: {correct: 1.0, format: 0.0}``).

The figure functions are pure (series in, ``matplotlib.figure.Figure`` out) and use matplotlib's object API with the
Agg canvas: no pyplot, no display, nothing changed in the user's matplotlib state. matplotlib is imported lazily.
"""

from __future__ import annotations

import fnmatch
import logging
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
from typing_extensions import override

from rl_lightning.compat import mlflow as mlflow_compat
from rl_lightning.tracking.history import Series, all_series, mlflow_loggers, read_history

log = logging.getLogger(__name__)

SMOOTH_FROM = 20  # points: from here on a series is drawn with its trailing mean
NEGLIGIBLE = 1e-6  # a `Panel.hide_zero` line whose values all stay below this (in size) is left out


@dataclass(frozen=True)
class Panel:
    """One question about a run, answered by one figure.

    Attributes:
        name: the file's stem (``reward`` -> ``reward.png``).
        title: the figure's title.
        ylabel: the y axis label, with its unit.
        lines: metric names or ``fnmatch`` patterns drawn as lines, one value per step (the training metrics).
        points: the same for validation points: dashed, with dots, in the colour of the line of the same metric
            (``val/x`` pairs with ``train/x``).
        hide_zero: leave out lines that are zero throughout, up to float noise (`NEGLIGIBLE`): ``train/mismatch_kl``
            with the HF engine, which samples with the trainer's own weights (1e-13 nats per token).
    """

    name: str
    title: str
    ylabel: str
    lines: tuple[str, ...] = ()
    points: tuple[str, ...] = ()
    hide_zero: bool = False


RL_PANELS = (
    Panel("reward", "Reward per rollout (dots: held-out validation)", "reward (mean per completion)",
          ("train/reward", "train/reward/*"), ("val/reward",)),
    Panel("heldout", "Held-out reward by component and validation set", "reward (mean over held-out completions)",
          points=("val/reward", "val/reward/*", "val/*/reward")),
    Panel("completion_length", "Completion length", "tokens per completion (mean)",
          ("train/completion_length",), ("val/completion_length",)),
    Panel("entropy", "Policy entropy on the sampled completions", "entropy (nats per token)", ("train/entropy",)),
    Panel("kl", "KL divergence", "KL (nats per token)", ("train/kl", "train/approx_kl", "train/mismatch_kl"),
          hide_zero=True),
    Panel("curriculum", "Prompt curriculum (data.curriculum): pools and pass-rate histogram", "prompts",
          ("curriculum/active", "curriculum/solved", "curriculum/hopeless", "curriculum/pass_rate/*")),
)
SFT_PANELS = (Panel("loss", "Loss (assistant tokens)", "cross-entropy (nats per token)", ("train/loss",),
                    ("val/loss",)),)
PAIR_PANELS = (
    Panel("loss", "Loss", "loss (mean per pair)", ("train/loss",), ("val/loss",)),
    Panel("accuracy", "Preference accuracy", "pairs ranked right (fraction)", ("train/accuracy",), ("val/accuracy",)),
    Panel("margin", "Reward margin", "chosen minus rejected reward (mean per pair)", ("train/margin",),
          ("val/margin",)),
)
LABELS = {"train/kl": "train/kl (to the reference)", "train/approx_kl": "train/approx_kl (to the rollout policy)",
          "train/mismatch_kl": "train/mismatch_kl (engine vs trainer)"}


def panels_for(names: Sequence[str]) -> tuple[tuple[Panel, ...], str]:
    """The panels for a run that logged metrics `names` (those with data), and its x axis label."""
    panels: tuple[Panel, ...]
    if "train/rollouts" in names:
        panels, xlabel = RL_PANELS, "rollout"
    else:
        panels, xlabel = (PAIR_PANELS if "train/pairs" in names else SFT_PANELS), "optimizer step"
    return tuple(p for p in panels if matching(p.lines + p.points, names)), xlabel


def matching(patterns: Sequence[str], names: Sequence[str]) -> list[str]:
    """The names matching any of `patterns`, in pattern order, then name order, each once."""
    out: list[str] = []
    for pattern in patterns:
        out += [n for n in sorted(names) if fnmatch.fnmatchcase(n, pattern) and n not in out]
    return out


def rolling_mean(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean: entry i is the mean of ``values[max(0, i - window + 1) : i + 1]``."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def drawn_lines(panel: Panel, series: dict[str, Series], hidden: Collection[str] = ()) -> tuple[list[str], list[str]]:
    """The metrics `panel` draws from `series`: ``(lines, points)``, without `hidden` and `Panel.hide_zero`'s zeros."""
    lines = [name for name in matching(panel.lines, list(series)) if name not in hidden
             and not (panel.hide_zero and max(map(abs, series[name].y), default=0.0) < NEGLIGIBLE)]
    return lines, [name for name in matching(panel.points, list(series)) if name not in hidden]


def draw(ax: Any, panel: Panel, series: dict[str, Series], xlabel: str, hidden: Collection[str] = ()) -> None:
    """Draw `panel` from `series` on the matplotlib axes `ax`: lines, validation points, title, labels, legend.

    Every line's ``gid`` is its metric's name (a trailing mean's: the name and ``:mean``), what tests look them up by.
    `hidden` metrics are left out (the components a run weighs 0).
    """
    from matplotlib.ticker import MaxNLocator

    colours: dict[str, str] = {}
    lines, points = drawn_lines(panel, series, hidden)
    for name in lines:
        x, y = series[name]
        label, smooth = LABELS.get(name, name), len(x) >= SMOOTH_FROM
        (line,) = ax.plot(x, y, label=f"_{label}" if smooth else label, gid=name, linewidth=1.2,
                          alpha=0.35 if smooth else 1.0, marker=None if smooth else ".")
        colours[name] = line.get_color()
        if smooth:  # the faint per-step line stays out of the legend
            window = max(3, len(x) // 10)
            ax.plot(x, rolling_mean(y, window), gid=f"{name}:mean", color=line.get_color(), linewidth=2.2,
                    label=f"{label} (mean of last {window})")
    for name in points:
        x, y = series[name]
        colour = colours.get("train/" + name.removeprefix("val/"))
        ax.plot(x, y, gid=name, linestyle="--", marker="o", markersize=5, linewidth=1.2, label=name,
                **({"color": colour} if colour else {}))
    ax.set_title(panel.title)
    drawn = [line.get_gid() for line in ax.get_lines()]
    ax.set_xlabel(f"{xlabel} (0 = start)" if any(0 in series[n].x for n in drawn if n in series) else xlabel)
    ax.set_ylabel(panel.ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    if ax.get_lines():
        ax.legend(fontsize="small", loc="best")


def panel_figure(panel: Panel, series: dict[str, Series], xlabel: str, hidden: Collection[str] = ()) -> Any:
    """One panel as its own ``matplotlib.figure.Figure`` (700 x 420 pixels)."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4.2), dpi=100, layout="constrained")
    draw(figure.add_subplot(), panel, series, xlabel, hidden)
    return figure


def summary_figure(panels: Sequence[Panel], series: dict[str, Series], xlabel: str, title: str,
                   hidden: Collection[str] = ()) -> Any:
    """Every panel in one figure, two a row, under `title`."""
    from matplotlib.figure import Figure

    columns = 1 if len(panels) == 1 else 2
    rows = math.ceil(len(panels) / columns)
    figure = Figure(figsize=(6.4 * columns, 3.8 * rows), dpi=100, layout="constrained")
    figure.suptitle(title, fontsize="x-large")
    for i, panel in enumerate(panels):
        draw(figure.add_subplot(rows, columns, i + 1), panel, series, xlabel, hidden)
    return figure


def write_plots(series: dict[str, Series], dirpath: str | Path, title: str, hidden: Collection[str] = ()) -> list[Path]:
    """Write one PNG per panel that draws something and ``summary.png`` into `dirpath`; returns their paths.

    A panel whose every line is `hidden` or zero throughout (`Panel.hide_zero`: the KL panel of a run with no KL term
    and on-policy updates) is left out, as one without data; none without any.
    """
    panels, xlabel = panels_for(list(series))
    panels = tuple(p for p in panels if any(drawn_lines(p, series, hidden)))
    if not panels:
        return []
    dirpath = Path(dirpath)
    dirpath.mkdir(parents=True, exist_ok=True)
    figures = [(p.name, panel_figure(p, series, xlabel, hidden)) for p in panels]
    figures.append(("summary", summary_figure(panels, series, xlabel, title, hidden)))
    paths = []
    for name, figure in figures:
        paths.append(dirpath / f"{name}.png")
        figure.savefig(paths[-1])
    return paths


def zero_weight_components(pl_module: Any) -> set[str]:
    """The metrics of the reward components an RL task weighs 0 (``train/reward/format``, ``val/reward/format``)."""
    weights = getattr(getattr(pl_module, "rollout_config", None), "reward_weights", None) or {}
    return {f"{split}/reward/{name}" for name, weight in weights.items() if weight == 0 for split in ("train", "val")}


class RunPlots(L.Callback):
    """Write the run's plots (see the module docstring) at the end of fit, and on a crash or an interrupt (rank 0).

    The metrics come from the first ``MLFlowLogger``'s run; every MLflow run gets the files as artifacts
    ``plots/*.png``. Without an MLflow logger there is nothing to read and no plots.

    Args:
        dirpath: the folder for the PNG files; default: ``plots/`` in the run's output folder through the CLI
            (`rl_lightning.cli.outputs.RunOutputs`), ``plots`` otherwise.
        enabled: false: no plots (an overlay turns the CLI's default off with ``init_args: {enabled: false}``).
    """

    def __init__(self, dirpath: str | None = None, enabled: bool = True) -> None:
        self.dirpath, self.enabled = dirpath, enabled

    @override
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.write(trainer, pl_module)

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        try:
            self.write(trainer, pl_module)
        except Exception as e:  # noqa: BLE001 - the run's own error is the one to report
            log.warning("could not write the plots: %s", e)

    def write(self, trainer: L.Trainer, pl_module: L.LightningModule) -> list[Path]:
        """Read the MLflow history, write the PNG files and log them; returns their paths."""
        loggers = mlflow_loggers(trainer)
        if not self.enabled or not trainer.is_global_zero or not loggers:
            return []
        first = loggers[0]
        history = read_history(first.experiment, mlflow_compat.started_run_id(first))
        title = f"{mlflow_compat.run_name(first) or type(pl_module).__name__} ({type(pl_module).__name__})"
        dirpath = Path(self.dirpath or "plots")
        paths = write_plots(all_series(history), dirpath, title, zero_weight_components(pl_module))
        for logger in loggers if paths else []:
            for path in paths:
                logger.experiment.log_artifact(mlflow_compat.started_run_id(logger), str(path), "plots")
        if paths:
            log.info("plots: %s", dirpath / "summary.png")
        return paths
