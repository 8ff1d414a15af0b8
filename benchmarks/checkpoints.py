"""How long checkpoints take, for a preset's full training state (float32 params and
AdamW state) on one device: the whole asynchronous save, the part of it that blocks
training (copying arrays off the device, fingerprints), and a restore (with its
fingerprint check).

    python benchmarks/checkpoints.py                        # the default config (shakespeare)
    python benchmarks/checkpoints.py --preset tiny --repeats 5 --dir /tmp/ckpt_bench

Any main.py config flag is accepted (--model.d_model 512 ...). The first save and
restore compile the fingerprint and warm Orbax up; they are not counted. Figures are
medians over --repeats. Last line: save_s=... blocked_s=... restore_s=...
"""

import os
import sys

if __name__ == "__main__" and not __package__:
    # Run as a file: its folder comes first on the path, where the repo's modules do not
    # import. Run it again as the module benchmarks.checkpoints, the repo's root on the path.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    os.execve(sys.executable, [sys.executable, "-m", "benchmarks.checkpoints", *sys.argv[1:]], {**os.environ, "PYTHONPATH": path})

import argparse
import shutil
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp

from parallel import optimizers
from parallel.mesh import make_mesh
from parallel.weights import init_params
from runtime import checkpoint
from runtime.flops import count_params, human
from serving.modes import directory_bytes
from utils import ConfigError, MeshConfig, apply_overrides, parse_args  # noqa: E402

BYTES_VOCAB = 257  # the byte tokenizer (256 bytes + end-of-text): the embedded data's vocabulary


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="measured saves and restores (median reported)")
    parser.add_argument("--dir", default="", help="where to write the checkpoints (default: a temporary directory)")
    args, config_flags = parser.parse_known_args(argv)
    jax.config.update("jax_num_cpu_devices", 1)  # before JAX starts its backend

    try:
        cfg = parse_args(config_flags)
    except ConfigError as e:
        sys.exit(f"error: {e}")
    if cfg.model.vocab_size == 0:
        cfg = apply_overrides(cfg, {"model": {"vocab_size": BYTES_VOCAB}})
    mesh = make_mesh(MeshConfig(dp=1, pp=1, tp=1), devices=jax.devices()[:1])
    _, params = init_params(cfg.model, mesh, False, cfg.run.seed)
    opt_state = optimizers.init_opt_state(optimizers.make_optimizer(cfg.train), params, mesh)
    # Fresh AdamW moments are zeros, which compress to nothing: give them values of the
    # size they have in training so that the bytes written are the real ones.
    keys = iter(jax.random.split(jax.random.key(cfg.run.seed), len(jax.tree.leaves(opt_state))))
    opt_state = jax.tree.map(lambda x: 1e-3 * jax.random.normal(next(keys), x.shape, x.dtype) if x.dtype == jnp.float32 else x,
                             opt_state)
    jax.block_until_ready((params, opt_state))
    total, _ = count_params(cfg.model)

    out = args.dir or tempfile.mkdtemp(prefix="bench_checkpoint_")
    run_dir = os.path.join(out, "run")
    shutil.rmtree(run_dir, ignore_errors=True)
    manager = checkpoint.checkpoint_manager(run_dir, keep=2)
    meta = dict(seed=cfg.run.seed, data_position=0, config={"model": vars(cfg.model)}, wandb_id=None)

    saves, blocked = [], []
    for step in range(args.repeats + 1):
        start = time.perf_counter()
        checkpoint.save_checkpoint(manager, step, params, opt_state, dict(meta, data_position=step))
        returned = time.perf_counter()
        manager.wait_until_finished()
        if step:  # step 0 warms up
            blocked.append(returned - start)
            saves.append(time.perf_counter() - start)
    size = directory_bytes(os.path.join(run_dir, "checkpoints", str(args.repeats)))

    restores = []
    for i in range(args.repeats + 1):
        start = time.perf_counter()
        fresh = checkpoint.checkpoint_manager(run_dir, keep=2)  # as a restarted run opens it
        restored = checkpoint.restore_checkpoint(fresh, params, opt_state, cfg.model, seed=cfg.run.seed)
        jax.block_until_ready(restored[:2])
        if i:
            restores.append(time.perf_counter() - start)
    if not args.dir:
        shutil.rmtree(out)

    save_s, blocked_s, restore_s = (statistics.median(x) for x in (saves, blocked, restores))
    print(f"preset {cfg.preset}: {human(total)} params; one checkpoint (params + AdamW state) {human(size)}B on disk; "
          f"median of {args.repeats}")
    print(f"save (async, until written) {save_s:.3f}s = {size / save_s / 1e6:.0f} MB/s; training blocked {blocked_s:.3f}s "
          f"({blocked_s / save_s:.0%} of it); restore {restore_s:.3f}s")
    print(f"save_s={save_s:.4f} blocked_s={blocked_s:.4f} restore_s={restore_s:.4f}")


if __name__ == "__main__":
    main(sys.argv[1:])
