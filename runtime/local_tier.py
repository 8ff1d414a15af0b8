"""The local checkpoint tier (--train.local_checkpoint_every N > 0; main.py imports this module only then).

Every N steps each process writes the shards it holds (params and optimizer state, float32 as trained) to its own
directory, <--train.local_checkpoint_dir, default <run_dir>/local>/process_<i>/<step>/: shards.npz (one member per
distinct shard, named leaf<k>@<start>:<stop>,...) and meta.json (the persistent tier's meta: step, seed, data position,
resolved config, each array's fingerprint). With n > 1 processes each one also passes its step (meta and shards.npz, as
bytes) to its peer (i + 1) % n in one collective permute (pass_along), which keeps it on its own disk as
process_<i+1>/peer_<i>/<step>/: one lost host (its directory gone) loses nothing. The device-to-host copy and the pass
block the loop; the file writes run in a thread, into <step>.tmp, renamed to <step> once complete; the KEEP newest steps
are kept. The persistent tier (runtime/checkpoint.py, --train.checkpoint_every) is unchanged, and a step it saves is not
saved here too.

On restart every process lists the complete local steps newer than the persistent tier's latest that it holds, its own and
its previous process's; a step counts when each process holds its own copy or its peer holds the replica. The newest one
that every process reads and whose fingerprints match (all_processes_agree) is restored onto the current mesh, which must
give every process the shards it wrote (the same mesh and process count; else the persistent tier is used). A process
without its own copy gets the replica passed back by its peer, and says so in a line. A step that fails to read is moved
aside (<step>.unreadable) with a line naming it, and the previous one tried. Local steps newer than the one resumed are
deleted, so a later restart never picks a step of an abandoned attempt.

Orbax's emergency manager (orbax.checkpoint.experimental.emergency.checkpoint_manager, orbax-checkpoint 0.12.8) is not
used: with one replica along its replica axis (one slice, the default and the 2-process test's mesh) it drops the local
directory and is the persistent manager alone; with several it needs every slice to hold a whole copy of the state and
restores a lost process's shards by broadcasting from another slice. Here a process's shards are its own (FSDP, tp, pp
split the state over processes), so it would give no local tier on the meshes this repo runs.
"""

import functools
import io
import json
import os
import shutil
import threading
import time

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from runtime.checkpoint import all_processes_agree, check_fingerprint, check_model_config, check_resume_config, fingerprint
from utils import ConfigError, config_to_dict

KEEP = 2  # local steps kept per process
LISTED = 8  # newest local steps each process offers when they agree on one
PEERS = "peers"  # the axis of pass_along's mesh: each process's first device


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


def pack(meta_json, npz_bytes):
    """One step as bytes: the meta's length (8 bytes, little-endian), the meta (JSON), shards.npz."""
    header = meta_json.encode()
    return len(header).to_bytes(8, "little") + header + npz_bytes


def unpack(payload):
    """(meta JSON text, shards.npz bytes) of pack()'s bytes."""
    length = int.from_bytes(payload[:8], "little")
    return payload[8:8 + length].decode(), payload[8 + length:]


@functools.cache
def peer_permute(by):
    """(the mesh of each process's first device, a jitted permute of its (processes, width) uint8 rows that gives process
    i's row to process (i + by) % n); built once per direction, so a save compiles it once."""
    n = jax.process_count()
    firsts = [min((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id) for p in range(n)]
    mesh = Mesh(np.array(firsts), (PEERS,))
    pairs = [(p, (p + by) % n) for p in range(n)]
    permute = jax.shard_map(lambda r: jax.lax.ppermute(r, PEERS, pairs), mesh=mesh, in_specs=PartitionSpec(PEERS),
                            out_specs=PartitionSpec(PEERS))
    return mesh, jax.jit(permute)


def pass_along(payload, by):
    """What process (i - by) % n gave, for this process i's `payload` (bytes) given to process (i + by) % n. Every process
    calls it at once: the lengths are all-gathered, then one collective permute of uint8 rows (padded to the longest)
    runs over a mesh of each process's first device (gloo on CPU, the interconnect on a pod)."""
    from jax.experimental import multihost_utils

    n, i = jax.process_count(), jax.process_index()
    lengths = np.asarray(multihost_utils.process_allgather(np.array([len(payload)], np.int64))).reshape(n)
    mesh, permute = peer_permute(by)
    row_1W = np.zeros((1, max(int(lengths.max()), 1)), np.uint8)
    row_1W[0, :len(payload)] = np.frombuffer(payload, np.uint8)
    rows_NW = jax.make_array_from_single_device_arrays((n, row_1W.shape[1]), NamedSharding(mesh, PartitionSpec(PEERS)),
                                                       [jax.device_put(row_1W, mesh.devices[i])])
    got_1W = np.asarray(permute(rows_NW).addressable_shards[0].data)
    return got_1W[0, :lengths[(i - by) % n]].tobytes()


class LocalTier:
    """This process's local checkpoints: save() every --train.local_checkpoint_every steps, restore() on start."""

    def __init__(self, cfg, run_dir):
        i, n = jax.process_index(), jax.process_count()
        self.root = os.path.abspath(cfg.train.local_checkpoint_dir or os.path.join(run_dir, "local"))
        self.directory = os.path.join(self.root, f"process_{i}")
        # the replica of the previous process's steps, on this disk (None with one process: no peer)
        self.held = os.path.join(self.directory, f"peer_{(i - 1) % n}") if n > 1 else None
        os.makedirs(self.held or self.directory, exist_ok=True)
        self.cfg, self.writer, self.error = cfg, None, None
        self.offered = None  # (own steps, held steps) of every process, from agreed_steps

    def complete_steps(self, directory=None):
        directory = directory or self.directory
        if not os.path.isdir(directory):
            return []
        return sorted((int(n) for n in os.listdir(directory) if n.isdigit()), reverse=True)

    # ---- Saving

    def save(self, run, state, step):
        """Copy this process's shards of `state` off the devices, pass them to the peer, then write both in a thread;
        charged to the checkpoint phase."""
        with run.clock.phase("checkpoint"):
            tree = dict(params=state.params, opt_state=state.opt_state)
            meta = json.dumps(dict(seed=self.cfg.run.seed, data_position=step, config=config_to_dict(self.cfg), step=step,
                                   wandb_id=run.reporter.log.wandb_id or state.wandb_id, fingerprint=fingerprint(tree),
                                   processes=jax.process_count(), leaves=len(jax.tree.leaves(tree))))
            shards, copies = host_shards(tree), []
            if self.held:
                buffer = io.BytesIO()
                np.savez(buffer, **shards)
                shards = buffer.getvalue()
                copies.append((self.held, *unpack(pass_along(pack(meta, shards), by=1))))
            self.wait()
            copies.insert(0, (self.directory, meta, shards))
            self.writer = threading.Thread(target=self._write, args=(step, copies), name="local-checkpoint")
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

    def _write(self, step, copies):
        try:
            for directory, meta, shards in copies:
                write_step(directory, step, meta, shards)
        except Exception as e:  # raised by the next save's wait()
            self.error = e

    # ---- Restoring

    def agreed_steps(self, newer_than):
        """The local steps newer than `newer_than` of which every process holds its own copy or its peer the replica,
        newest first; keeps what every process offered in self.offered."""
        own = [s for s in self.complete_steps() if s > newer_than][:LISTED]
        if jax.process_count() == 1:
            return own
        from jax.experimental import multihost_utils

        held = [s for s in self.complete_steps(self.held) if s > newer_than][:LISTED]
        padded = np.full((2, LISTED), -1, np.int64)
        padded[0, :len(own)], padded[1, :len(held)] = own, held
        n = jax.process_count()
        everyone = np.asarray(multihost_utils.process_allgather(padded)).reshape(n, 2, LISTED)
        self.offered = [(set(everyone[p, 0].tolist()), set(everyone[p, 1].tolist())) for p in range(n)]
        steps = set().union(*(o | h for o, h in self.offered)) - {-1}
        return sorted((s for s in steps if all(s in self.offered[p][0] or s in self.offered[(p + 1) % n][1]
                                               for p in range(n))), reverse=True)

    def read_a_copy(self, step, template):
        """read() of this process's own copy of `step`, or of the replica its peer passes back when it has none (then a
        line says so). Every process calls it at once: a pass runs when any process lacks its own copy."""
        n, i = jax.process_count(), jax.process_index()
        lacking = [p for p in range(n) if n > 1 and step not in self.offered[p][0]]
        if lacking:
            payload = b""
            if (i - 1) % n in lacking:  # the previous process's replica is on this disk
                try:
                    payload = read_step_bytes(os.path.join(self.held, str(step)))
                except OSError:
                    pass  # an empty payload fails to read there, and every process moves on
            got = pass_along(payload, by=-1)
            if i in lacking:
                replica = os.path.join(self.root, f"process_{(i + 1) % n}", f"peer_{i}", str(step))
                print(f"process {i} reads local step {step} from its peer's replica {replica} ({self.directory} holds "
                      f"no step {step})", flush=True)  # on every process that does (`say` prints on process 0 only)
                meta, shards = unpack(got)
                return self.read(json.loads(meta), io.BytesIO(shards), template)
        where = os.path.join(self.directory, str(step))
        with open(os.path.join(where, "meta.json")) as f:
            meta = json.load(f)
        return self.read(meta, os.path.join(where, "shards.npz"), template)

    def read(self, meta, shards_npz, template):
        """(restored tree shaped like `template`, meta) from a local step's meta and shards.npz (a path or a file);
        raises for a damaged file or another mesh."""
        leaves, treedef = jax.tree.flatten(template)
        if meta["processes"] != jax.process_count() or meta["leaves"] != len(leaves):
            raise ValueError(f"written by {meta['processes']} process(es) for {meta['leaves']} arrays, not "
                             f"{jax.process_count()} and {len(leaves)}")
        restored = []
        with np.load(shards_npz) as npz:
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
        where = os.path.join(self.directory, str(step))
        if not os.path.isdir(where):  # (the replica its peer passed failed to read)
            print(f"skipping local step {step}: its replica failed to read ({type(error).__name__}: {str(error)[:300]})",
                  flush=True)
            return
        os.rename(where, f"{where}.unreadable")
        print(f"skipping the local checkpoint {where} ({type(error).__name__}: {str(error)[:300]}); moved to "
              f"{where}.unreadable, trying the previous step", flush=True)

    def drop_newer_than(self, step):
        for directory in (self.directory, self.held):
            for s in self.complete_steps(directory) if directory else []:
                if s > step:
                    shutil.rmtree(os.path.join(directory, str(s)), ignore_errors=True)

    def persistent_line(self, step, directory):
        """The one line of a resume from the persistent tier while the local tier is on."""
        return f"resumed from step {step} of the persistent tier ({directory}/{step}); no newer complete step in the local tier"


def write_step(directory, step, meta_json, shards):
    """<directory>/<step>/ (meta.json, shards.npz from a {key: uint8} dict or its bytes) through <step>.tmp; keeps the KEEP
    newest steps there."""
    final, tmp = os.path.join(directory, str(step)), os.path.join(directory, f"{step}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    if isinstance(shards, dict):
        np.savez(os.path.join(tmp, "shards.npz"), **shards)
    else:
        with open(os.path.join(tmp, "shards.npz"), "wb") as f:
            f.write(shards)
    with open(os.path.join(tmp, "meta.json"), "w") as f:
        f.write(meta_json)
    shutil.rmtree(final, ignore_errors=True)  # the same step of an abandoned attempt
    os.rename(tmp, final)
    for old in sorted((int(n) for n in os.listdir(directory) if n.isdigit()), reverse=True)[KEEP:]:
        shutil.rmtree(os.path.join(directory, str(old)), ignore_errors=True)


def read_step_bytes(where):
    """pack()'s bytes of the local step in `where`."""
    with open(os.path.join(where, "meta.json")) as f, open(os.path.join(where, "shards.npz"), "rb") as g:
        return pack(f.read(), g.read())
