"""Plots of a run: PNGs from <run_dir>/metrics.jsonl and config.json, drawn at the end of training (main.py) or by
`python utils.py plot RUN_DIR`; without pyplot, so no global backend or figure state changes."""

import importlib
import json
import math
import os
import sys

import numpy as np

from runtime.flops import human
from runtime.goodput import PHASES
from runtime.metrics import read_metrics

PLOT_DPI = 150  # a 6.4 x 4.4 inch figure is 960 x 660 px: sharp at README width
SMOOTH_FROM = 50  # from this many train-loss points on, a smoothed curve is drawn over the raw one
HEATMAP_COLUMNS = 200  # expert-load heatmaps average longer runs down to this many columns


def plot_series(rows, key):
    """(steps, values) of the rows that carry `key`."""
    picked = [(r["step"], r[key]) for r in rows if key in r]
    return [s for s, _ in picked], [v for _, v in picked]


def smoothed(values, window):
    """Centred moving average over `window` points (fewer at the ends): it does not lag a falling loss as an EMA does."""
    v, kernel = np.asarray(values, float), np.ones(window)
    return (np.convolve(v, kernel, "same") / np.convolve(np.ones_like(v), kernel, "same")).tolist()


def binned(steps, values_S, max_bins):
    """(steps, values) averaged into at most `max_bins` bins of consecutive rows (against aliasing); unchanged when short."""
    if len(steps) <= max_bins:
        return np.asarray(steps, float), np.asarray(values_S, float)
    groups = np.array_split(np.arange(len(steps)), max_bins)
    steps, values_S = np.asarray(steps, float), np.asarray(values_S, float)
    return np.array([steps[g].mean() for g in groups]), np.stack([values_S[g].mean(0) for g in groups])


def cell_edges(centers):
    """Edges of heatmap cells centred on sorted, possibly unevenly spaced x values (e.g. a gap left by a resume)."""
    c = np.asarray(centers, float)
    if len(c) == 1:
        return np.array([c[0] - 0.5, c[0] + 0.5])
    mid = (c[1:] + c[:-1]) / 2
    return np.concatenate([[2 * c[0] - mid[0]], mid, [2 * c[-1] - mid[-1]]])


def line_data(line):
    """(x, y) as a Line2D holds them: what was actually drawn."""
    return np.asarray(line.get_xdata(), float).tolist(), np.asarray(line.get_ydata(), float).tolist()


def human_ticks(axis):
    from matplotlib.ticker import FuncFormatter

    axis.set_major_formatter(FuncFormatter(lambda x, _: human(x)))


def step_ticks(axis):
    from matplotlib.ticker import MaxNLocator

    axis.set_major_locator(MaxNLocator(integer=True))


def draw_loss(fig, rows, cfg):
    """Train and validation loss against tokens seen (step on top); on a right axis max_logit (and its qk_clip bound, dashed)."""
    tokens_per_step = cfg["train"]["batch_size"] * cfg["model"]["seq_len"]
    steps, loss = plot_series(rows, "loss")
    val_steps, val_loss = plot_series(rows, "val_loss")
    if not steps and not val_steps:
        return None
    ax = fig.subplots()
    tokens = [s * tokens_per_step for s in steps]
    drawn = {}
    if len(loss) >= SMOOTH_FROM:
        (raw,) = ax.plot(tokens, loss, color="tab:blue", alpha=0.3, lw=0.8, label="train (raw)")
        window = max(5, len(loss) // 100 * 2 + 1)  # odd, so the average is centred on each point
        (smooth,) = ax.plot(tokens, smoothed(loss, window), color="tab:blue", lw=1.8, label="train (smoothed)")
        drawn["train_smoothed"] = line_data(smooth)
    else:
        (raw,) = ax.plot(tokens, loss, color="tab:blue", lw=1.5, label="train")
    drawn["train"] = line_data(raw)
    val_tokens = [s * tokens_per_step for s in val_steps]
    eval_capacity = cfg["train"].get("eval_capacity_factor")  # (absent in runs older than the flag)
    val_label = {None: "validation", 0: "validation (dropless)"}.get(eval_capacity, f"validation (capacity factor {eval_capacity})")
    (val,) = ax.plot(val_tokens, val_loss, "o-", color="tab:orange", ms=4, label=val_label)
    drawn["val"] = line_data(val)
    human_ticks(ax.xaxis)
    step_axis = ax.secondary_xaxis("top", functions=(lambda t: t / tokens_per_step, lambda s: s * tokens_per_step))
    step_axis.set_xlabel("step")
    step_ticks(step_axis.xaxis)
    human_ticks(step_axis.xaxis)
    ax.set(xlabel=f"tokens seen ({human(tokens_per_step)} per step)", ylabel="cross-entropy (nats/token)", title=f"loss, run {cfg['run']['name']}")
    handles = [line for line in ax.get_lines() if not line.get_label().startswith("_")]
    handles += draw_max_logit(ax, rows, cfg, tokens_per_step, drawn)
    ax.legend(handles=handles, labels=[h.get_label() for h in handles])
    ax.grid(alpha=0.3)
    return drawn


def draw_max_logit(ax, rows, cfg, tokens_per_step, drawn):
    """max_logit on a twin axis of the loss's (rows without it: nothing); the lines drawn."""
    steps, max_logit = plot_series(rows, "max_logit")
    if not steps:
        return []
    logit_ax = ax.twinx()
    (line,) = logit_ax.plot([s * tokens_per_step for s in steps], max_logit, color="tab:red", lw=1.0, label="max attention logit")
    drawn["max_logit"] = line_data(line)
    lines = [line]
    tau = cfg["train"].get("qk_clip", 0)
    if tau:
        lines.append(logit_ax.axhline(tau, color="tab:red", ls="--", lw=0.8, label=f"--train.qk_clip {tau:g}"))
    logit_ax.set_ylabel("largest attention logit", color="tab:red")
    return lines


def draw_load_balance(fig, rows, cfg):
    """Load-balance loss, and the share of routed assignments dropped at capacity."""
    steps, aux = plot_series(rows, "aux_loss")
    if not any(aux):  # a dense model
        return None
    drop_steps, dropped = plot_series(rows, "dropped_frac")
    fig.set_size_inches(6.4, 5.6)
    ax, ax2 = fig.subplots(2, 1, sharex=True)
    (aux_line,) = ax.plot(steps, aux, color="tab:purple")
    ax.axhline(1.0, color="gray", ls="--", lw=1, label="1 = perfectly balanced")
    ax.set(ylabel="load-balance loss", title="load-balance loss (Switch; mean over MoE layers)")
    ax.legend()
    (drop_line,) = ax2.plot(drop_steps, [100 * d for d in dropped], color="tab:red")
    factor = cfg["model"]["capacity_factor"]
    ax2.set(xlabel="step", ylabel="dropped (%)", ylim=(0, None), title=f"token-to-expert assignments dropped at capacity (factor {factor:g})"
            if factor else "token-to-expert assignments dropped (dropless routing)")
    for a in (ax, ax2):
        a.grid(alpha=0.3)
    step_ticks(ax2.xaxis)
    fig.suptitle(f"routing balance, run {cfg['run']['name']}")
    return {"aux_loss": line_data(aux_line), "dropped_percent": line_data(drop_line)}


def draw_expert_load(fig, rows, cfg):
    """Fraction of routed tokens per expert over steps, one heatmap per MoE block; white is the uniform share 1/E."""
    from matplotlib.colors import TwoSlopeNorm
    from matplotlib.ticker import MaxNLocator

    steps, loads = plot_series(rows, "expert_load")
    load_SNE = np.asarray(loads, float)
    moe_blocks = [n for n in range(load_SNE.shape[1]) if load_SNE[:, n].any()] if loads else []
    if not moe_blocks:  # a dense model
        return None
    steps, load_SNE = binned(steps, load_SNE, HEATMAP_COLUMNS)
    n_experts = load_SNE.shape[2]
    uniform = 1 / n_experts
    norm = TwoSlopeNorm(vmin=0, vcenter=uniform, vmax=max(load_SNE.max(), 2 * uniform))
    ncols = min(4, math.ceil(len(moe_blocks) / 4))
    nrows = math.ceil(len(moe_blocks) / ncols)
    fig.set_size_inches(max(6.4, 0.8 + 3.4 * ncols), 1.2 + 1.5 * nrows)
    axes = fig.subplots(nrows, ncols, sharex=True, sharey=True, squeeze=False)
    x_edges, e_edges = cell_edges(steps), np.arange(n_experts + 1) - 0.5
    drawn = {}
    for ax, n in zip(axes.flat, moe_blocks):
        mesh = ax.pcolormesh(x_edges, e_edges, load_SNE[:, n, :].T, cmap="RdBu_r", norm=norm)
        ax.set_title(f"block {n}", fontsize=9)
        drawn[f"block{n}"] = (steps.tolist(), np.asarray(mesh.get_array(), float).T.tolist())  # [step][expert]
    for i, ax in enumerate(axes.flat):
        if i >= len(moe_blocks):
            ax.set_visible(False)
        elif i + ncols >= len(moe_blocks):  # nothing drawn below: this panel carries the step axis
            ax.set_xlabel("step")
            ax.xaxis.set_tick_params(labelbottom=True)
        if i % ncols == 0:
            ax.set_ylabel("expert")
    axes[0, 0].invert_yaxis()  # expert 0 on top (the axes share y)
    axes[0, 0].yaxis.set_major_locator(MaxNLocator(integer=True, nbins=min(n_experts, 8)))
    axes[0, 0].xaxis.set_major_locator(MaxNLocator(integer=True, nbins=5))
    human_ticks(axes[0, 0].xaxis)
    colorbar = fig.colorbar(mesh, ax=axes, label=f"fraction of routed tokens\n(white = uniform 1/{n_experts})")
    colorbar.set_ticks([0, uniform / 2, uniform, *np.linspace(uniform, norm.vmax, 4)[1:]])
    colorbar.ax.yaxis.set_major_formatter("{x:.3g}")
    fig.suptitle(f"expert load per MoE block, run {cfg['run']['name']}")
    return drawn


def draw_router_bias(fig, rows, cfg):
    """Each expert's router bias (aux-loss-free balancing) over steps, one panel per MoE layer."""
    steps, biases = plot_series(rows, "router_bias")
    if not biases:  # balancing off
        return None
    steps, bias_SLE = binned(steps, np.asarray(biases, float), HEATMAP_COLUMNS)
    n_layers, n_experts = bias_SLE.shape[1:]
    ncols = min(4, n_layers)
    nrows = math.ceil(n_layers / ncols)
    fig.set_size_inches(max(6.4, 0.8 + 3.4 * ncols), 1.6 + 1.8 * nrows)
    axes = fig.subplots(nrows, ncols, sharex=True, sharey=True, squeeze=False)
    drawn = {}
    for layer, ax in enumerate(axes.flat):
        if layer >= n_layers:
            ax.set_visible(False)
            continue
        lines = ax.plot(steps, bias_SLE[:, layer, :], lw=1)
        ax.axhline(0, color="gray", lw=0.8)
        ax.set_title(f"MoE layer {layer}", fontsize=9)
        ax.grid(alpha=0.3)
        drawn[f"layer{layer}"] = (np.asarray(lines[0].get_xdata(), float).tolist(),
                              np.stack([np.asarray(line.get_ydata(), float) for line in lines], axis=1).tolist())
        if layer + ncols >= n_layers:
            ax.set_xlabel("step")
            ax.xaxis.set_tick_params(labelbottom=True)
        if layer % ncols == 0:
            ax.set_ylabel("selection bias")
    step_ticks(axes[0, 0].xaxis)
    fig.legend(lines, [f"expert {e}" for e in range(n_experts)], loc="outside right upper", fontsize=7)
    fig.suptitle(f"router bias per expert (rate {cfg['model']['router_bias_rate']:g} per step), run {cfg['run']['name']}")
    return drawn


def draw_speed(fig, rows, cfg):
    """Tokens per second and MFU per logged step, with their medians."""
    steps, tokens_per_sec = plot_series(rows, "tokens_per_sec")
    mfu_steps, mfu = plot_series(rows, "mfu")
    if not steps:
        return None
    fig.set_size_inches(6.4, 5.6)
    ax, ax2 = fig.subplots(2, 1, sharex=True)
    (speed_line,) = ax.plot(steps, tokens_per_sec, color="tab:blue", lw=1)
    median = float(np.median(tokens_per_sec))
    ax.axhline(median, color="gray", ls="--", lw=1, label=f"median {human(median)} tokens/s")
    human_ticks(ax.yaxis)
    ax.set(ylabel="tokens/s", ylim=(0, None), title="throughput (whole mesh)")
    (mfu_line,) = ax2.plot(mfu_steps, [100 * m for m in mfu], color="tab:green", lw=1)
    if mfu:
        median_mfu = float(np.median(mfu))
        ax2.axhline(100 * median_mfu, color="gray", ls="--", lw=1, label=f"median {median_mfu:.1%}")
    ax2.set(xlabel="step", ylabel="MFU (%)", ylim=(0, None), title="model FLOPs utilisation (of a measured matmul peak)")
    for a in (ax, ax2):
        a.legend(loc="lower right")
        a.grid(alpha=0.3)
    step_ticks(ax2.xaxis)
    fig.suptitle(f"speed, run {cfg['run']['name']}")
    return {"tokens_per_sec": line_data(speed_line), "mfu_percent": line_data(mfu_line)}


def draw_goodput(fig, rows, cfg):
    """Where the wall time went (runtime/goodput.py): phases as one stacked bar, and steps over wall time, restarts shaded."""
    totals_rows = [r for r in rows if "goodput" in r]
    if not totals_rows:
        return None
    last = totals_rows[-1]
    seconds = [last["goodput"].get(p, 0.0) for p in PHASES]
    wall = sum(seconds)
    fig.set_size_inches(7.2, 5.2)
    bar_ax, time_ax = fig.subplots(2, 1, height_ratios=[1, 2.2])
    colors = dict(startup="tab:gray", compile="tab:purple", train="tab:green", eval="tab:blue", checkpoint="tab:orange",
                  data="tab:cyan", redone="tab:red", down="darkred", other="lightgray")
    left, drawn = 0.0, {}
    for phase, s in zip(PHASES, seconds):
        if s <= 0:
            continue
        bar_ax.barh(0, s, left=left, color=colors[phase], label=f"{phase} {s / wall:.0%}")
        drawn[phase] = s
        left += s
    bar_ax.set(xlim=(0, wall), yticks=[], xlabel="seconds of wall time",
               title=f"goodput: train steps {drawn.get('train', 0) / wall:.0%} of {wall:.0f}s")
    bar_ax.legend(ncols=5, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.55))
    start = last["run_start"]
    timed = [r for r in rows if "loss" in r and "time" in r]
    (line,) = time_ax.plot([r["time"] - start for r in timed], [r["step"] for r in timed], ".", ms=3, color="tab:green", label="train step logged")
    for r in rows:
        if r.get("event") == "restart":  # steps redone: checkpoint to the last sign of life; down: from there to the new start
            stopped, started = r["stopped_at"] - start, r["started_at"] - start
            time_ax.axvspan(stopped - r["redone_s"], stopped, color=colors["redone"], alpha=0.25)
            time_ax.axvspan(stopped, started, color=colors["down"], alpha=0.25)
            time_ax.annotate(f"restart {r['restart']}: {r['steps_redone']} steps redone,\n"
                             f"{r['redone_s'] + r['down_s']:.0f}s lost ({r['reason'][:40]})",
                             (stopped - r["redone_s"], r["step"]), fontsize=7, va="bottom")
    time_ax.set(xlabel="seconds since the run started", ylabel="step", xlim=(0, wall),
                title="steps over wall time (shaded: lost to a restart, steps redone then down)")
    step_ticks(time_ax.yaxis)
    time_ax.grid(alpha=0.3)
    fig.suptitle(f"where the time went, run {cfg['run']['name']}")
    return {"seconds": drawn, "steps": line_data(line)}


def drawn_by(module, flag):
    """A plot of runtime/<module>.py's `draw`, imported only for a run whose config sets `flag` (section, field)."""
    def draw(fig, rows, cfg):
        return importlib.import_module(f"runtime.{module}").draw(fig, rows, cfg) if cfg.get(flag[0], {}).get(flag[1]) else None
    return draw


PLOTS = {"loss.png": draw_loss, "load_balance.png": draw_load_balance, "expert_load.png": draw_expert_load,
         "router_bias.png": draw_router_bias, "speed.png": draw_speed, "goodput.png": draw_goodput,
         "sources.png": drawn_by("source_plots", ("data", "mixture")), "tasks.png": drawn_by("task_plots", ("eval", "tasks"))}


def plot_run(run_dir):
    """Write the PLOTS PNGs (those with something to show) into run_dir. Returns {file name: {series: data}} read back
    from what was drawn: (x, y) for lines (percent where the axis says %), (steps, [step][expert]) for heatmaps."""
    from matplotlib.figure import Figure

    rows = read_metrics(run_dir)
    with open(os.path.join(run_dir, "config.json")) as f:
        cfg = json.load(f)
    drawn = {}
    for name, draw in PLOTS.items():
        fig = Figure(figsize=(6.4, 4.4), layout="constrained")
        series = draw(fig, rows, cfg)
        if series is not None:
            fig.savefig(os.path.join(run_dir, name), dpi=PLOT_DPI)
            drawn[name] = series
    return drawn


def main(args):
    """`python utils.py plot RUN_DIR [RUN_DIR ...]`: redraw each run's PNGs, print their paths."""
    if len(args) >= 2 and args[0] == "plot":
        for run_dir in args[1:]:
            for needed in ("metrics.jsonl", "config.json"):
                if not os.path.exists(os.path.join(run_dir, needed)):
                    sys.exit(f"error: {run_dir} has no {needed}: give a run directory (<run.out_dir>/<run.name>) "
                             "of a run that has logged at least one step")
            for name in plot_run(run_dir):
                print(os.path.join(run_dir, name))
    else:
        sys.exit("usage: python utils.py plot RUN_DIR [RUN_DIR ...]")


if __name__ == "__main__":  # run by `python utils.py plot RUN_DIR` (utils.py imports nothing of the project)
    main(sys.argv[1:])
