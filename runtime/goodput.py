"""Goodput: where a run's wall time went, across its restarts. Every second from the first process's start to the last
one's end counts in exactly one of PHASES (PhaseClock switches them, so an attempt's phases sum to its elapsed time):
startup (process start, imports, devices, data, init or restore); compile (the train step); train (train steps, and waiting
for the devices when metrics are read); eval (with its compile); checkpoint (what blocked training: device copies,
fingerprints, a preemption's synchronous save, the final wait); data (waiting for a batch); redone (lost: steps computed
twice, resumed checkpoint to last logged step); down (lost: stopped attempt's last sign of life to the new start); other.
DeviceWatch adds `host_held_s` (devices idle between steps) and `device_busy_s`. metrics.jsonl gets the running totals in a
`goodput` row after every checkpoint and at the end, and a `restart` row per resume; a resumed attempt continues its totals."""

import os
import queue
import threading
import time
from contextlib import contextmanager

PHASES = ("startup", "compile", "train", "eval", "checkpoint", "data", "redone", "down", "other")
LOST = ("redone", "down")  # lost to restarts
OUTSIDE_STEPS = ("eval", "checkpoint")  # between two steps, these phases own the gap, not the host
DEVICE_TOTALS = ("host_held_s", "device_busy_s")  # DeviceWatch's, on the rows beside `goodput`


def process_start_time():
    """Unix time this process started, so the interpreter and imports count (Linux:
    /proc/self/stat field 22 against the boot clock, 10 ms resolution; elsewhere: now)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # fields after the command name start at field 3
        since_boot = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - since_boot
    except (OSError, ValueError, IndexError, AttributeError):
        return time.time()


class PhaseClock:
    """The phases of this attempt (from its process start), plus the totals carried over from earlier attempts."""

    def __init__(self, start=None):
        self.start = process_start_time() if start is None else start
        self.run_start = self.start  # the first attempt's start (a resume moves it back)
        self.carried = dict.fromkeys(PHASES, 0.0)  # earlier attempts' totals and the time lost between
        self.spent = dict.fromkeys(PHASES, 0.0)
        self.current, self.since = "startup", self.start
        self.watch = DeviceWatch()
        self.carried_devices = dict.fromkeys(DEVICE_TOTALS, 0.0)

    def switch(self, phase):
        """Charge the time since the last switch to the current phase; `phase` from now on."""
        now = time.time()
        self.spent[self.current] += now - self.since
        self.current, self.since = phase, now
        return now

    @contextmanager
    def phase(self, name):
        if name in OUTSIDE_STEPS:
            self.watch.pause()
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
        """The metrics.jsonl row with the running totals; its `time` and `run_start` let the next attempt continue them."""
        totals = self.totals()
        return dict(step=step, event=event, time=round(time.time(), 3), run_start=round(self.run_start, 3),
                    goodput={p: round(s, 3) for p, s in totals.items()},
                    **{k: round(s, 3) for k, s in self.device_totals().items()})

    def device_totals(self):
        """{"host_held_s", "device_busy_s"} of the whole run so far (DeviceWatch)."""
        return dict(host_held_s=self.carried_devices["host_held_s"] + self.watch.held,
                    device_busy_s=self.carried_devices["device_busy_s"] + self.watch.busy)

    def resume(self, rows, step, reason):
        """Continue the totals of a run resumed from checkpoint `step`, whose metrics.jsonl rows (before the cut back to `step`)
        are `rows`. Returns the `restart` row to log, or None when the rows do not say when the run stopped (e.g. a fresh run)."""
        base = [r for r in rows if r.get("event") in ("checkpoint", "local_checkpoint", "preempted") and r["step"] <= step]
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
        self.carried_devices = {k: base.get(k, 0.0) for k in DEVICE_TOTALS}  # (rows from before DeviceWatch: 0)
        n = sum(1 for r in rows if r.get("event") == "restart" and r["step"] <= step) + 1
        return dict(step=step, event="restart", restart=n, reason=reason, steps_redone=last_step - step,
                    redone_s=round(redone, 3), down_s=round(down, 3), stopped_at=round(alive, 3),
                    started_at=round(self.start, 3), time=round(time.time(), 3))


def summary(totals, restarts=0, devices=None):
    """One line: the wall time and each phase's fraction of it; with `devices`
    (PhaseClock.device_totals), the share of the wall and of the steps' time the host held them."""
    wall = sum(totals.values())
    lost = sum(totals[p] for p in LOST)
    parts = [f"{p} {totals[p] / wall:.1%}" for p in PHASES if p not in LOST and totals[p] > 0]
    if restarts or lost:
        parts.append(f"lost to {restarts} restart(s) {lost / wall:.1%} (steps redone {totals['redone']:.1f}s, down {totals['down']:.1f}s)")
    line = f"goodput: {wall:.1f}s of wall time = " + " + ".join(parts)
    if devices:
        held, busy = devices["host_held_s"], devices["device_busy_s"]
        line += (f"; the host held the devices {held / wall:.1%} of the wall ({held:.1f}s between steps, "
                 f"{held / max(held + busy, 1e-9):.1%} of the steps' time; the steps kept them busy {busy:.1f}s)")
    return line


class DeviceWatch:
    """Train steps' device time, seen from the host: a thread waits on each dispatched step's output. `held` sums the idle
    gaps max(0, next dispatch - previous end), `busy` end - max(dispatch, previous end); a pause (eval, checkpoint) leaves the
    next gap out. An end is seen when the thread gets the GIL (within 5 ms), so a gap may read that much short."""

    def __init__(self):
        self.held = self.busy = 0.0
        self.steps = 0  # steps timed
        self._queue, self._thread = queue.SimpleQueue(), None

    def dispatched(self, array):
        """A step was just dispatched; `array` (one of its outputs) is ready when it ends."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._wait_for_steps, name="goodput-device-watch", daemon=True)
            self._thread.start()
        self._queue.put((time.perf_counter(), array))

    def pause(self):
        self._queue.put("pause")

    def close(self):
        """Wait until every dispatched step is timed (the totals are final then)."""
        if self._thread is not None:
            self._queue.put("stop")
            self._thread.join()
            self._thread = None

    def _wait_for_steps(self):
        previous_end = None  # the last step's end, None after a pause
        while (item := self._queue.get()) != "stop":
            if item == "pause":
                previous_end = None
                continue
            dispatched_at, array = item
            try:
                array.block_until_ready()
            except Exception:  # the step failed: the loop reports it; stop timing
                return
            end = time.perf_counter()
            started = dispatched_at if previous_end is None else max(dispatched_at, previous_end)
            if previous_end is not None:
                self.held += max(dispatched_at - previous_end, 0.0)
            self.busy += end - started
            self.steps += 1
            previous_end = end
