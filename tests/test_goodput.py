"""goodput.DeviceWatch: how long the host held the devices between train steps, timed
against a real jitted step and host pauses the test measures itself."""

import time

import jax
import jax.numpy as jnp
import pytest

from runtime import goodput


@jax.jit
def step(x_NN):
    """A stand-in train step: four 512^3 matmuls, tens of ms on this CPU."""
    for _ in range(4):
        x_NN = jnp.tanh(x_NN @ x_NN)
    return x_NN


def test_device_watch_counts_the_gaps_the_host_leaves_and_the_steps_time():
    x_NN = jnp.full((512, 512), 0.01)
    step(x_NN).block_until_ready()  # compiled before anything is timed
    watch = goodput.DeviceWatch()

    # Five steps queued back to back: the devices never wait for the host.
    started = time.perf_counter()
    for _ in range(5):
        x_NN = step(x_NN)
        watch.dispatched(x_NN)
    x_NN.block_until_ready()
    busy_s = time.perf_counter() - started
    watch.pause()  # an evaluation would run here: its time is not a gap between steps
    time.sleep(0.3)

    # Four steps, each waited for, then 0.15 s of "host work" before the next dispatch.
    held_s, previous_end = 0.0, None
    for _ in range(4):
        x_NN = step(x_NN)
        dispatched = time.perf_counter()
        watch.dispatched(x_NN)
        x_NN.block_until_ready()
        end = time.perf_counter()
        busy_s += end - dispatched
        held_s += 0.0 if previous_end is None else dispatched - previous_end
        previous_end = end
        time.sleep(0.15)
    watch.close()

    assert watch.steps == 9
    assert held_s >= 0.45  # three gaps of at least 0.15 s; the one across the pause left out
    assert watch.held == pytest.approx(held_s, abs=0.03), (watch.held, held_s)
    assert watch.busy == pytest.approx(busy_s, rel=0.1, abs=0.03), (watch.busy, busy_s)

    # The rows carry the totals, a resume continues them, the summary line says them.
    clock = goodput.PhaseClock(start=time.time() - 1.0)
    clock.watch = watch
    clock.switch("train")
    row = clock.row(9, "checkpoint")
    assert (row["host_held_s"], row["device_busy_s"]) == (round(watch.held, 3), round(watch.busy, 3))
    resumed = goodput.PhaseClock(start=row["time"] + 2)
    resumed.resume([row], 9, "a test")
    assert resumed.device_totals() == {"host_held_s": row["host_held_s"], "device_busy_s": row["device_busy_s"]}
    totals = resumed.totals()  # (the clock runs on: the line and the figures below read one reading)
    line = goodput.summary(totals, restarts=1, devices=resumed.device_totals())
    held, busy = row["host_held_s"], row["device_busy_s"]
    wall = sum(totals.values())
    assert (f"the host held the devices {held / wall:.1%} of the wall ({held:.1f}s between steps, "
            f"{held / (held + busy):.1%} of the steps' time; the steps kept them busy {busy:.1f}s)") in line, line
