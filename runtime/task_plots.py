"""tasks.png of a run with --eval.tasks (runtime/harness.py): each task's scores (`eval/<task>/<metric>` rows) against the
tokens seen, a panel per task. runtime/plots.py draws it only for a run with --eval.tasks."""

from runtime.source_plots import drawn_xy, series, source_names

PREFIX = "eval/"


def draw(fig, rows, cfg):
    """A panel per task, a line per metric (perplexities on a log axis); the lines drawn, by task and metric."""
    from matplotlib.ticker import FuncFormatter

    from runtime.flops import human

    tokens_per_step = cfg["train"]["batch_size"] * cfg["model"]["seq_len"]
    keys = source_names(rows, PREFIX)  # "<task>/<metric>"
    tasks = sorted({key.split("/")[0] for key in keys})
    if not tasks:
        return None
    axes = fig.subplots(1, len(tasks), squeeze=False)[0]
    drawn = {}
    for ax, task in zip(axes, tasks):
        for key in (k for k in keys if k.split("/")[0] == task):
            metric = key.split("/", 1)[1]
            (line,) = ax.plot(*series(rows, PREFIX + key, tokens_per_step), "o-", ms=3, label=metric)
            drawn.setdefault(task, {})[metric] = drawn_xy(line)
        if any("perplexity" in metric for metric in drawn[task]):
            ax.set_yscale("log")
        ax.set(xlabel="tokens seen", title=task)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: human(x)))
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(f"lm-evaluation-harness tasks in the loop, run {cfg['run']['name']}")
    return drawn
