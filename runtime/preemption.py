"""Save on the signal, everywhere at once.

In --mode train, SIGTERM (TPU maintenance, spot preemption) or SIGINT makes every process stop at one agreed step,
save there synchronously, print one line and exit with PREEMPTED_EXIT_CODE; the same command resumes bit for bit. One
process stops after the step in flight. Several use JAX's preemption sync manager, which owns SIGTERM (SIGINT is
re-sent as SIGTERM): its per-step check is local, so the host never waits for a step (docs/benchmarks.md); with
jax_enable_preemption_service=False, a flag is all-gathered every step. A second signal changes nothing.
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
