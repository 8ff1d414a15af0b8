"""Training progress on stderr: tqdm's bar on a terminal, else a plain line every
--log.every steps (step, loss, tokens/s, MFU): in a log file, tqdm's carriage-return
frames would pile up into one huge line.
"""

import sys
import time


class PlainProgress:
    """tqdm's interface as training uses it, printing `train step S/N (P%) loss=... elapsed Ts`
    to `file` every `every` steps and at the last; write() prints to stdout, as tqdm.write."""

    def __init__(self, total, initial, every, file=None):
        self.total, self.n, self.every = total, initial, max(every, 1)
        self.file = file or sys.stderr
        self.postfix, self.start, self.due = {}, time.perf_counter(), False

    def update(self, n=1):
        self.n += n
        self.due = self.n % self.every == 0 or self.n == self.total

    def set_postfix(self, refresh=False, **values):
        self.postfix = values
        if self.due:  # the step's own figures arrive after its update
            self.print_line()

    def print_line(self):
        self.due = False
        values = " ".join(f"{k}={v}" for k, v in self.postfix.items())
        percent = f" ({self.n / self.total:.0%})" if self.total else ""
        line = " ".join(part for part in (f"train step {self.n}/{self.total}{percent}", values,
                                          f"elapsed {time.perf_counter() - self.start:.0f}s") if part)
        print(line, file=self.file, flush=True)

    def write(self, line):
        print(line, file=sys.stdout, flush=True)

    def close(self):
        if self.due:
            self.print_line()


def make_progress(total, initial, every, enabled, stream=None):
    """tqdm's bar when `stream` (default stderr) is a terminal, else plain lines."""
    from tqdm import tqdm

    stream = stream or sys.stderr
    if not enabled:  # still a tqdm: its write() prints the val_loss lines
        return tqdm(total=total, initial=initial, disable=True)
    if stream.isatty():
        return tqdm(total=total, initial=initial, dynamic_ncols=True, desc="train", file=stream)
    return PlainProgress(total, initial, every, stream)
