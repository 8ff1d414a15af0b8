"""sources.png of a run trained on a mixture (data/mixture.py): each source's validation loss beside the mixture's, and
the tokens each source has given, against the tokens seen. runtime/plots.py draws it only for a run with --data.mixture."""

from runtime.flops import human


def source_names(rows, prefix):
    return sorted({key[len(prefix):] for row in rows for key in row if key.startswith(prefix)})


def series(rows, key, tokens_per_step):
    """(tokens seen, values) of the rows that carry `key` (runtime/plots.py imports this module: it cannot import that one)."""
    picked = [(row["step"] * tokens_per_step, row[key]) for row in rows if key in row]
    return [t for t, _ in picked], [v for _, v in picked]


def drawn_xy(line):
    return [float(x) for x in line.get_xdata()], [float(y) for y in line.get_ydata()]


def draw(fig, rows, cfg):
    """Left: val_loss and val_loss/<name>; right: tokens/<name> (cumulative). The lines drawn, by panel and source."""
    from matplotlib.ticker import FuncFormatter

    tokens_per_step = cfg["train"]["batch_size"] * cfg["model"]["seq_len"]
    loss_ax, tokens_ax = fig.subplots(1, 2)
    drawn = {"val_loss": {}, "tokens": {}}
    for name in ["", *source_names(rows, "val_loss/")]:
        style = "o-" if name else "k--"  # the mixture's (weighted mean): dashed
        (line,) = loss_ax.plot(*series(rows, f"val_loss/{name}" if name else "val_loss", tokens_per_step), style, ms=3,
                               label=name or "mixture (weighted)")
        drawn["val_loss"][name or "mixture"] = drawn_xy(line)
    for name in source_names(rows, "tokens/"):
        (line,) = tokens_ax.plot(*series(rows, f"tokens/{name}", tokens_per_step), label=name)
        drawn["tokens"][name] = drawn_xy(line)
    loss_ax.set(xlabel="tokens seen", ylabel="validation cross-entropy (nats/token)", title="validation loss per source")
    tokens_ax.set(xlabel="tokens seen", ylabel="tokens from the source", title="tokens per source")
    for axis in (loss_ax.xaxis, tokens_ax.xaxis, tokens_ax.yaxis):
        axis.set_major_formatter(FuncFormatter(lambda x, _: human(x)))
    for ax in (loss_ax, tokens_ax):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(f"mixture {cfg['data']['mixture']}, run {cfg['run']['name']}")
    return drawn
