"""Save on the signal, everywhere at once.

TPU VMs get a SIGTERM before maintenance, and preemptible and spot VMs one before they
are taken away. The training process (--mode train only: serving keeps its own shutdown)
catches SIGTERM and SIGINT; every process then agrees on one step to stop at, saves a
checkpoint there synchronously, prints one line and exits with PREEMPTED_EXIT_CODE.
Starting the same command again resumes from that checkpoint, bit for bit.

How the processes agree:
- One process: the handler sets a flag; the loop stops after the step in flight.
- Several processes (jax.distributed): JAX's preemption sync manager. It owns SIGTERM
  (a C++ handler installed by jax.distributed.initialize): a signalled process tells the
  coordination service, which tells every process; they exchange the steps they have
  reached once, in the background, and `reached_preemption_sync_point(step)` is true on
  every process at the same step (the largest reached + 1). Per step it is a local check
  (~6-8 us measured on this machine, 2 processes over gloo on 127.0.0.1), so the devices
  never wait for it; an all-reduce of a flag each step would make the host wait for every
  step to finish. SIGINT is turned into a SIGTERM to this process, so that Ctrl-C on one
  host takes the same path. Works with the CPU/gloo backend of the pinned JAX (checked:
  SIGTERM to one of two processes, both stop at the same step).
- Several processes with JAX's preemption service turned off
  (jax_enable_preemption_service=False): a flag all-gathered every step (it waits for
  the step; slower, but it agrees).

A second signal while saving changes nothing: the flag is already set, and JAX's
notifier reports a preemption once.
"""

import os
import signal

import jax
import numpy as np
from jax._src import distributed  # JAX's preemption sync manager lives on its state
from jax.experimental import multihost_utils

PREEMPTED_EXIT_CODE = 75  # sysexits.h EX_TEMPFAIL: a temporary failure, "the user is invited to retry"
SIGNALS = (signal.SIGTERM, signal.SIGINT)


def jax_sync_manager():
    """JAX's preemption sync manager when jax.distributed runs with it, else None."""
    return distributed.global_state.preemption_sync_manager if distributed.global_state.client else None


class Preemption:
    """Catches SIGTERM and SIGINT while it is installed (a `with` block around training)
    and says at which step every process stops (should_stop)."""

    def __init__(self):
        self.processes = jax.process_count()
        self.received = None  # the first signal's name, in this process
        self.previous = {}

    def __enter__(self):
        self.jax_owns_sigterm = self.processes > 1 and jax_sync_manager() is not None
        for sig in SIGNALS:
            if sig == signal.SIGTERM and self.jax_owns_sigterm:
                continue  # JAX's notifier is installed for it; a Python handler would replace it
            self.previous[sig] = signal.signal(sig, self.handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}

    def handle(self, signum, frame):
        if self.received is not None:
            return  # a second signal: the first one's save goes on
        self.received = signal.Signals(signum).name
        if self.jax_owns_sigterm:
            os.kill(os.getpid(), signal.SIGTERM)  # SIGINT: tell JAX's notifier, which tells every process

    def should_stop(self, step):
        """Whether every process stops after `step`; call it once per step, on every process."""
        if self.processes == 1:
            return self.received is not None
        if self.jax_owns_sigterm:
            return multihost_utils.reached_preemption_sync_point(step)
        return bool(np.any(multihost_utils.process_allgather(np.asarray(self.received is not None))))

    def why(self):
        if self.processes == 1:
            return f"{self.received} received"
        return (f"a preemption notice (SIGTERM or SIGINT to a process of this run{', here ' + self.received if self.received else ''}); "
                f"all {self.processes} processes stop at this step")
