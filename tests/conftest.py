"""Every test process sees 8 fake CPU devices, set before JAX starts, so that the
parallel tests can build any mesh up to 8 devices; single-device tests use device 0."""

import os

from devices import use_fake_cpu_devices

use_fake_cpu_devices(8)
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
