"""Goodput: where a run's wall time went, across its restarts.

A run's wall time runs from the start of its first process to the end of its last. It is
split into phases, each second counted in exactly one:

  startup     the process start (interpreter, imports), devices, data, init or restore
  compile     compiling the train step
  train       train steps (dispatch, and waiting for the devices when metrics are read)
  eval        evaluations (the eval step compiles on its first use: counted here)
  checkpoint  checkpoint time that blocked training (copying off the devices, fingerprints,
              a synchronous save on preemption, the final wait for the writes)
  data        waiting for the host to read and place a batch
  redone      steps computed twice: from the checkpoint a restart resumed from to the
              last step the stopped attempt logged (lost to the restart)
  down        from the stopped attempt's last sign of life to the new process's start
              (lost to the restart)
  other       the rest (samples and plots at the end)

Phases are switched (PhaseClock.phase), not summed from separate timers, so at any
moment the phases of an attempt add up to its elapsed time exactly. metrics.jsonl
carries the running totals in a `goodput` row after every checkpoint and at the end
(and a `restart` row per resume); the next attempt starts from the totals of the
checkpoint it resumed from and adds what was lost in between (restart_row).
"""

import os
import time
from contextlib import contextmanager

PHASES = ("startup", "compile", "train", "eval", "checkpoint", "data", "redone", "down", "other")
LOST = ("redone", "down")  # lost to restarts


def process_start_time():
    """Unix time at which this process started, so that the interpreter's start and the
    imports count. Linux: its start in clock ticks after boot (/proc/self/stat, field 22,
    10 ms resolution) against the boot clock; elsewhere: now."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # fields after the command name start at field 3
        since_boot = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - since_boot
    except (OSError, ValueError, IndexError, AttributeError):
        return time.time()


class PhaseClock:
    """The phases of this attempt (from its process start), plus the totals carried
    over from earlier attempts."""

    def __init__(self, start=None):
        self.start = process_start_time() if start is None else start
        self.run_start = self.start  # the first attempt's start (a resume moves it back)
        self.carried = dict.fromkeys(PHASES, 0.0)  # earlier attempts' totals and the time lost between
        self.spent = dict.fromkeys(PHASES, 0.0)
        self.current, self.since = "startup", self.start

    def switch(self, phase):
        """Charge the time since the last switch to the current phase; `phase` from now on."""
        now = time.time()
        self.spent[self.current] += now - self.since
        self.current, self.since = phase, now
        return now

    @contextmanager
    def phase(self, name):
        previous = self.current
        self.switch(name)
        try:
            yield
        finally:
            self.switch(previous)

    def totals(self):
        """{phase: seconds} of the whole run so far (they add up to now - run_start)."""
        now = time.time()
        return {p: self.carried[p] + self.spent[p] + (now - self.since if p == self.current else 0.0) for p in PHASES}

    def row(self, step, event):
        """The metrics.jsonl row with the running totals: its `time` and `run_start` let the
        next attempt continue them."""
        totals = self.totals()
        return dict(step=step, event=event, time=round(time.time(), 3), run_start=round(self.run_start, 3),
                    goodput={p: round(s, 3) for p, s in totals.items()})

    def resume(self, rows, step, reason):
        """Continue the totals of the run whose metrics.jsonl rows (before the cut back to
        `step`) are `rows`, resumed from checkpoint `step`. Returns the `restart` row to
        log, or None when the rows do not say when the run stopped (a run from before
        goodput rows, or a fresh run)."""
        base = [r for r in rows if r.get("event") in ("checkpoint", "preempted") and r["step"] <= step]
        if not base:
            return None
        base = base[-1]  # the totals up to the checkpoint resumed from (or just before it)
        alive = max([r["time"] for r in rows if "time" in r] + [base["time"]])  # the stopped attempt's last sign of life
        last_step = max([r["step"] for r in rows if "loss" in r] + [step])
        redone, down = max(alive - base["time"], 0.0), max(self.start - alive, 0.0)
        self.run_start = base["run_start"]
        self.carried = {p: base["goodput"].get(p, 0.0) for p in PHASES}
        self.carried["redone"] += redone
        self.carried["down"] += down
        n = sum(1 for r in rows if r.get("event") == "restart" and r["step"] <= step) + 1
        return dict(step=step, event="restart", restart=n, reason=reason, steps_redone=last_step - step,
                    redone_s=round(redone, 3), down_s=round(down, 3), stopped_at=round(alive, 3),
                    started_at=round(self.start, 3), time=round(time.time(), 3))


def summary(totals, restarts=0):
    """One line: the wall time and each phase's fraction of it (they add up to 1)."""
    wall = sum(totals.values())
    lost = sum(totals[p] for p in LOST)
    parts = [f"{p} {totals[p] / wall:.1%}" for p in PHASES if p not in LOST and totals[p] > 0]
    if restarts or lost:
        parts.append(f"lost to {restarts} restart(s) {lost / wall:.1%} (steps redone {totals['redone']:.1f}s, "
                     f"down {totals['down']:.1f}s)")
    return f"goodput: {wall:.1f}s of wall time = " + " + ".join(parts)
