"""Every test process sees 8 fake CPU devices, set before JAX starts, so that the
parallel tests can build any mesh up to 8 devices; single-device tests use device 0."""

import os

import jax

from main import allow_slow_fake_devices

jax.config.update("jax_num_cpu_devices", 8)
allow_slow_fake_devices()  # 8 device threads on 2 cores: a collective may wait over 40 s
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
