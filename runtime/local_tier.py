"""The local checkpoint tier (--train.local_checkpoint_every N > 0; main.py imports this module only then).

Every N steps each process writes the shards it holds (params and optimizer state, float32 as trained) to its own
directory, <--train.local_checkpoint_dir, default <run_dir>/local>/process_<i>/<step>/: shards.npz (one member per
distinct shard, named leaf<k>@<start>:<stop>,...) and meta.json (the persistent tier's meta: step, seed, data position,
resolved config, each array's fingerprint). The device-to-host copy blocks the loop; the file write runs in a thread,
into <step>.tmp, renamed to <step> once complete; the KEEP newest steps are kept. With several processes the same
thread then writes a replica of that step into its peer's directory, process_<(i+1)%n>/peer_<i>/<step>/ (the same
tmp-then-rename), so a process whose own directory is gone (a host replaced) reads its shards from there. The persistent tier
(runtime/checkpoint.py, --train.checkpoint_every) is unchanged, and a step it saves is not saved here too.

On restart every process lists its complete local steps newer than the persistent tier's latest; the newest one that
every process holds, reads and whose fingerprints match (all_processes_agree) is restored onto the current mesh, which
must give every process the shards it wrote (the same mesh and process count; else the persistent tier is used). A step
that fails to read, in the process's own directory and in its peer's replica, is moved aside (<step>.unreadable) with a
line naming it, and the previous one tried; a process that reads the replica says so in a line. Local steps
newer than the one resumed are deleted, so a later restart never picks a step of an abandoned attempt.

Orbax's emergency manager (orbax.checkpoint.experimental.emergency.checkpoint_manager, orbax-checkpoint 0.12.8) is not
used: with one replica along its replica axis (one slice, the default and the 2-process test's mesh) it drops the local
directory and is the persistent manager alone; with several it needs every slice to hold a whole copy of the state and
restores a lost process's shards by broadcasting from another slice. Here a process's shards are its own (FSDP, tp, pp
split the state over processes), so it would give no local tier on the meshes this repo runs. The replica reaches the peer's directory through the
file system: on one machine, or with --train.local_checkpoint_dir on storage every host mounts; on a pod whose hosts'
local disks are private it would need a transfer between processes, which is not done here (docs/checkpoints.md).
"""

import json
import os
import shutil
import threading
import time

import jax
import numpy as np

from runtime.checkpoint import all_processes_agree, check_fingerprint, check_model_config, check_resume_config, fingerprint
from utils import ConfigError, config_to_dict

KEEP = 2  # local steps kept per process
LISTED = 8  # newest local steps each process offers when they agree on one


def shard_key(leaf_number, index, shape):
    """'leaf<k>@<start>:<stop>,...': one shard of the k-th leaf, whatever slices (None or ints) `index` uses."""
    bounds = [f"{s.start or 0}:{dim if s.stop is None else s.stop}" for s, dim in zip(index, shape)]
    return f"leaf{leaf_number}@" + ",".join(bounds)


def shard_shape(index, shape):
    return tuple((dim if s.stop is None else s.stop) - (s.start or 0) for s, dim in zip(index, shape))


def host_shards(tree):
    """{shard_key: the shard's bytes (uint8)} for each distinct shard this process holds, copied off the devices."""
    keys, datas = [], []
    for k, leaf in enumerate(jax.tree.leaves(tree)):
        for shard in leaf.addressable_shards:
            key = shard_key(k, shard.index, leaf.shape)
            if key not in keys:
                keys.append(key)
                datas.append(shard.data)
    return {key: np.ascontiguousarray(a).reshape(-1).view(np.uint8) for key, a in zip(keys, jax.device_get(datas))}


class LocalTier:
    """This process's local checkpoints: save() every --train.local_checkpoint_every steps, restore() on start."""

    def __init__(self, cfg, run_dir):
        root = cfg.train.local_checkpoint_dir or os.path.join(run_dir, "local")
        i, n = jax.process_index(), jax.process_count()
        self.directory = os.path.abspath(os.path.join(root, f"process_{i}"))
        # this process's replica, in its peer's directory (None with one process: no peer)
        self.replica = os.path.abspath(os.path.join(root, f"process_{(i + 1) % n}", f"peer_{i}")) if n > 1 else None
        for where in (self.directory, self.replica):
            if where:
                os.makedirs(where, exist_ok=True)
        self.cfg, self.writer, self.error = cfg, None, None

    def complete_steps(self, directory=None):
        directory = directory or self.directory
        return sorted((int(n) for n in os.listdir(directory) if n.isdigit()), reverse=True)

    def copies(self, step):
        """The complete copies of local `step` this process can read: its own, then its peer's replica."""
        return [os.path.join(d, str(step)) for d in (self.directory, self.replica) if d and step in self.complete_steps(d)]

    # ---- Saving

    def save(self, run, state, step):
        """Copy this process's shards of `state` off the devices, then write them in a thread; charged to the checkpoint phase."""
        with run.clock.phase("checkpoint"):
            tree = dict(params=state.params, opt_state=state.opt_state)
            meta = dict(seed=self.cfg.run.seed, data_position=step, config=config_to_dict(self.cfg), step=step,
                        wandb_id=run.reporter.log.wandb_id or state.wandb_id, fingerprint=fingerprint(tree),
                        processes=jax.process_count(), leaves=len(jax.tree.leaves(tree)))
            shards = host_shards(tree)
            self.wait()
            self.writer = threading.Thread(target=self._write, args=(step, shards, meta), name="local-checkpoint")
            self.writer.start()
        run.reporter.log.write(run.clock.row(step, "local_checkpoint"))

    def wait(self):
        """Until the last write is on disk; raises its error, if any."""
        if self.writer is not None:
            self.writer.join()
            self.writer = None
        if self.error is not None:
            error, self.error = self.error, None
            raise RuntimeError(f"writing a local checkpoint in {self.directory} failed") from error

    def _write(self, step, shards, meta):
        try:
            for directory in (self.directory, self.replica):
                if directory:
                    self._write_into(directory, step, shards, meta)
        except Exception as e:  # raised by the next save's wait()
            self.error = e

    def _write_into(self, directory, step, shards, meta):
        final, tmp = os.path.join(directory, str(step)), os.path.join(directory, f"{step}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        np.savez(os.path.join(tmp, "shards.npz"), **shards)
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f)
        shutil.rmtree(final, ignore_errors=True)  # the same step of an abandoned attempt
        os.rename(tmp, final)
        for old in self.complete_steps(directory)[KEEP:]:
            shutil.rmtree(os.path.join(directory, str(old)), ignore_errors=True)

    # ---- Restoring

    def agreed_steps(self, newer_than):
        """The local steps newer than `newer_than` that every process holds, newest first."""
        held = set(self.complete_steps()).union(self.complete_steps(self.replica) if self.replica else [])
        mine = sorted((s for s in held if s > newer_than), reverse=True)[:LISTED]
        if jax.process_count() == 1:
            return mine
        from jax.experimental import multihost_utils

        padded = np.full(LISTED, -1, np.int64)
        padded[:len(mine)] = mine
        everyone = np.asarray(multihost_utils.process_allgather(padded)).reshape(jax.process_count(), LISTED)
        common = set(everyone[0].tolist()).intersection(*(set(row.tolist()) for row in everyone[1:])) - {-1}
        return sorted(common, reverse=True)

    def read_a_copy(self, step, template):
        """read() of this process's own copy of `step`, else of its peer's replica (with a line saying so); raises the
        first copy's error when none reads."""
        errors = []
        for where in self.copies(step):
            try:
                tree, meta = self.read(where, template)
            except Exception as e:
                errors.append(e)
                continue
            if not where.startswith(self.directory + os.sep):
                why = f"its own copy failed: {errors[0]}" if errors else f"{self.directory} holds no step {step}"
                # every process that reads a replica says so (`log` prints on the main process only)
                print(f"process {jax.process_index()} reads local step {step} from its peer's replica {where} ({why})",
                      flush=True)
            return tree, meta
        raise errors[0] if errors else FileNotFoundError(f"no copy of local step {step}")

    def read(self, where, template):
        """(restored tree shaped like `template`, meta) of the local step in `where`; raises for a damaged file or another
        mesh."""
        with open(os.path.join(where, "meta.json")) as f:
            meta = json.load(f)
        leaves, treedef = jax.tree.flatten(template)
        if meta["processes"] != jax.process_count() or meta["leaves"] != len(leaves):
            raise ValueError(f"written by {meta['processes']} process(es) for {meta['leaves']} arrays, not "
                             f"{jax.process_count()} and {len(leaves)}")
        restored = []
        with np.load(os.path.join(where, "shards.npz")) as npz:
            cache = {}
            for k, leaf in enumerate(leaves):
                arrays = []
                for device, index in leaf.sharding.addressable_devices_indices_map(leaf.shape).items():
                    key = shard_key(k, index, leaf.shape)
                    if key not in npz.files:
                        raise ValueError(f"no shard {key}: written on another mesh")
                    if key not in cache:
                        cache[key] = np.frombuffer(npz[key].tobytes(), leaf.dtype).reshape(shard_shape(index, leaf.shape))
                    arrays.append(jax.device_put(cache[key], device))
                restored.append(jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, arrays))
        return jax.tree.unflatten(treedef, restored), meta

    def check_meta(self, meta):
        """The persistent tier's refusals: another model, seed, batch size, schedule or optimizer."""
        check_model_config(meta["config"]["model"], self.cfg.model, self.directory)
        if meta["seed"] != self.cfg.run.seed:
            raise ConfigError(f"the local checkpoints in {self.directory} were written with --run.seed {meta['seed']}, not "
                              f"{self.cfg.run.seed}: resume with that seed, or start another --run.name")
        check_resume_config(meta["config"]["train"], self.cfg.train, self.directory)

    def restore(self, params, opt_state, persistent_step, log):
        """(params, opt_state, meta) of the newest local step newer than `persistent_step` (None: no persistent checkpoint)
        that every process reads and verifies, or None; meta["resumed_from"] is the line to print."""
        newer_than = -1 if persistent_step is None else persistent_step
        if self.cfg.train.resume_step >= 0:  # a persistent step the user asked for
            self.drop_newer_than(self.cfg.train.resume_step)
            return None
        template = dict(params=params, opt_state=opt_state)
        for step in self.agreed_steps(newer_than):
            t0, tree, meta, error = time.perf_counter(), None, None, RuntimeError("it failed on another process")
            try:
                tree, meta = self.read_a_copy(step, template)
            except Exception as e:
                error = e
            if all_processes_agree(tree is not None):
                self.check_meta(meta)
                try:
                    check_fingerprint(meta["fingerprint"], tree, f"local checkpoint step {step}")
                except ValueError as e:
                    tree, error = None, e
            if all_processes_agree(tree is not None):
                self.drop_newer_than(step)
                meta["resumed_from"] = (f"resumed from step {step} of the local tier ({self.directory}/{step} on each process; "
                                        f"read in {time.perf_counter() - t0:.1f}s)")
                return tree["params"], tree["opt_state"], meta
            self.set_aside(step, error, log)
        self.drop_newer_than(newer_than)
        return None

    def set_aside(self, step, error, log):
        if isinstance(error, RuntimeError) and str(error) == "it failed on another process":
            log(f"skipping local checkpoint step {step}: it failed on another process")
            return
        for where in self.copies(step):
            os.rename(where, f"{where}.unreadable")
            print(f"skipping the local checkpoint {where} ({type(error).__name__}: {str(error)[:300]}); moved to "
                  f"{where}.unreadable, trying the previous step", flush=True)

    def drop_newer_than(self, step):
        for directory in (self.directory, self.replica):
            for s in self.complete_steps(directory) if directory else []:
                if s > step:
                    shutil.rmtree(os.path.join(directory, str(s)), ignore_errors=True)

    def persistent_line(self, step, directory):
        """The one line of a resume from the persistent tier while the local tier is on."""
        return f"resumed from step {step} of the persistent tier ({directory}/{step}); no newer complete step in the local tier"
