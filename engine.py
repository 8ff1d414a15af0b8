"""Batched decoding for the server: a fixed number of slots over one latent KV cache.

Each slot holds one sequence. Every iteration, one compiled step samples the next token
of every slot (each with its own temperature, top-k, top-p and random key), and one
compiled decode step runs all slots' new tokens through the model at once, each row at
its own position (model.decode_step with per-row starts). A sequence that finishes
frees its slot and a waiting one takes it at the next iteration (continuous batching):
its prompt is prefilled alone, padded to one of a few bucketed lengths so that prefill
compiles a handful of times, not once per prompt length.

Every slot follows main.generate's rules exactly, so a greedy completion here is the
text `--mode sample --sample.temperature 0` prints, and a seeded sample the one
`--mode sample --sample.seed S` prints: the same key chain, top-k and window restart.
The cache holds one training window (seq_len); when a slot's window is full, it
restarts from its last half window (a fresh prefill), as nanoGPT crops its context.

The engine deals in token ids; serve.py turns them into text, stop strings and HTTP.
It runs the model on one device, or with --mesh.tp n on n devices with the heads,
hidden units and vocabulary split as in training (place_weights).
"""

import collections
import functools
import threading
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model import decode_step, init_cache

MIN_PREFILL_BUCKET = 16  # shorter prompts are padded to this: one compile covers them all
TOP_LOGPROBS = 5  # alternatives computed at every position (OpenAI's API allows up to 5)


def prefill_buckets(window):
    """Prompt lengths prefill is compiled for: powers of two from MIN_PREFILL_BUCKET up,
    and the window itself. A prompt is padded to the next one; padding sits after the
    prompt, so causal attention keeps it from touching the prompt's logits, and the
    slots it fills in the cache are overwritten before any query can see them."""
    sizes, size = [], MIN_PREFILL_BUCKET
    while size < window:
        sizes.append(size)
        size *= 2
    return sizes + [window]


# ----------------------------------------------------------------------------
# The compiled pieces (graphdef and shapes are static; each compiles once per shape)


def real_vocab_only(logprobs_XV, vocab):
    """Padded vocabulary entries are no tokens: never offered as alternatives."""
    return jnp.where(jnp.arange(logprobs_XV.shape[-1]) < vocab, logprobs_XV, -jnp.inf)


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(3, 4))
def prefill_slot(graphdef, vocab, state, cache, logits_SV, tokens_1T, length, slot):
    """Prefill one prompt (padded to T) into row `slot` of the cache, from a fresh row.

    Returns the cache, logits_SV with the slot's next-token logits (at length - 1), and
    for every prompt position t: the log-probability of token t+1 and the top
    alternatives (for `echo` with `logprobs`). Log-probabilities are the model's
    log-softmax over its whole (padded) vocabulary, the distribution its loss uses.
    """
    model = nnx.merge(graphdef, state)
    logits_1TV, row = decode_step(model, tokens_1T, init_cache(model.cfg, 1, cache[0][0].shape[2]), 0)
    cache = [(kv.at[:, slot].set(row_kv[:, 0]), rope.at[:, slot].set(row_rope[:, 0]))
             for (kv, rope), (row_kv, row_rope) in zip(cache, row)]
    logits_SV = logits_SV.at[slot].set(logits_1TV[0, length - 1])
    logprobs_TV = jax.nn.log_softmax(logits_1TV[0])
    next_T = jnp.roll(tokens_1T[0], -1)
    next_logprob_T = jnp.take_along_axis(logprobs_TV, next_T[:, None], axis=-1)[:, 0]
    top_logprob_TN, top_id_TN = jax.lax.top_k(real_vocab_only(logprobs_TV, vocab), TOP_LOGPROBS)
    return cache, logits_SV, (next_logprob_T, top_id_TN, top_logprob_TN)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def decode_slots(graphdef, state, cache, tokens_S, positions_S):
    """One new token per slot, each at its own position: the next logits [S, V]."""
    logits_S1V, cache = decode_step(nnx.merge(graphdef, state), tokens_S[:, None], cache, positions_S)
    return cache, logits_S1V[:, 0]


def sample_row(key, last_V, temperature, top_k, top_p):
    """main.generate's sampling for one row, with per-row settings as arrays: the
    temperature, then the top_k mask exactly as there (top_k 0 = all), then top_p
    (nucleus, Holtzman et al. 2019; 1 = off, and then not applied at all so that the
    draw is main.generate's), then the same jax.random.categorical."""
    vocab = last_V.shape[0]
    scaled_V = last_V / jnp.where(temperature > 0, temperature, 1.0)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.sort(scaled_V)[vocab - k]
    scaled_V = jnp.where(scaled_V < kth, -jnp.inf, scaled_V)
    descending_V = jnp.sort(scaled_V)[::-1]
    probs_V = jax.nn.softmax(descending_V)
    kept = jnp.sum((jnp.cumsum(probs_V) - probs_V) < top_p)  # tokens whose predecessors hold < top_p
    nucleus_V = jnp.where(scaled_V < descending_V[jnp.maximum(kept, 1) - 1], -jnp.inf, scaled_V)
    scaled_V = jnp.where(top_p < 1, nucleus_V, scaled_V)
    return jax.random.categorical(key, scaled_V)


@functools.partial(jax.jit, static_argnums=0)
def sample_slots(vocab, logits_SV, key_data_S2, temperature_S, top_k_S, top_p_S):
    """The next token of every slot, its log-probability and the top alternatives.
    Greedy rows (temperature 0) take the argmax, as main.generate does; sampled rows
    split their key once per token, as main.generate does."""
    last_SV = logits_SV[:, :vocab]  # padded vocabulary entries are never sampled
    keys_S2 = jax.vmap(jax.random.split)(jax.random.wrap_key_data(key_data_S2))
    sampled_S = jax.vmap(sample_row)(keys_S2[:, 1], last_SV, temperature_S, top_k_S, top_p_S)
    token_S = jnp.where(temperature_S > 0, sampled_S, jnp.argmax(last_SV, axis=-1))
    logprobs_SV = jax.nn.log_softmax(logits_SV)
    logprob_S = jnp.take_along_axis(logprobs_SV, token_S[:, None], axis=-1)[:, 0]
    top_logprob_SN, top_id_SN = jax.lax.top_k(real_vocab_only(logprobs_SV, vocab), TOP_LOGPROBS)
    return token_S, jax.random.key_data(keys_S2[:, 0]), logprob_S, top_id_SN, top_logprob_SN


def key_data(seed):
    return np.asarray(jax.random.key_data(jax.random.key(seed)))


def place_weights(state, tp_devices=None):
    """The weights on one device, or with tp_devices (a list of n), split over them as
    training's tensor parallelism splits them (weights.WEIGHTS' TP dims: heads,
    hidden units, vocabulary rows; the rest replicated). Then jit partitions every step
    (GSPMD) and adds the all-reduces; the latent KV cache has no head dim, so it is
    replicated. Plain arrays first: a sharded array keeps its mesh's axis types."""
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    import parallel as par
    from weights import row

    plain = jax.tree.map(np.asarray, state.to_pure_dict())
    if not tp_devices or len(tp_devices) == 1:
        return nnx.State(jax.device_put(plain, (tp_devices or jax.devices())[0]))
    mesh = jax.make_mesh((len(tp_devices),), (par.TP,), axis_types=(AxisType.Auto,), devices=tp_devices)

    def sharding(path, leaf):
        name = par.weight_name(path)
        dims = tuple(par.TP if d == par.TP else None for d in row(name).dims)
        return NamedSharding(mesh, P(*((None,) * (leaf.ndim - len(dims)) + dims)))  # stacked: N leads

    return nnx.State(jax.device_put(plain, jax.tree_util.tree_map_with_path(sharding, plain)))


# ----------------------------------------------------------------------------
# Sequences and the engine


class QueueFull(Exception):
    """More sequences are waiting than --serve.queue allows."""


class Sequence:
    """One prompt's generation: its settings, and `emit`, called from the engine's
    thread with ("prompt", next_logprob_T, top_id_TN, top_logprob_TN) after the prefill
    (only with want_prompt_logprobs), ("token", id, logprob, top_id_N, top_logprob_N)
    per token, and last ("done", "length" | "cancelled" | "error: ...")."""

    def __init__(self, prompt_ids, max_tokens, temperature, top_k, top_p, seed, emit, want_prompt_logprobs=False):
        self.prompt_ids, self.max_tokens, self.emit = list(prompt_ids), max_tokens, emit
        self.temperature, self.top_k, self.top_p, self.seed = temperature, top_k, top_p, seed
        self.want_prompt_logprobs = want_prompt_logprobs
        self.cancelled = False  # set from any thread; the engine frees the slot at its next step

    def cancel(self):
        self.cancelled = True


class Slot:
    """Where one sequence stands: its tokens since the last (re)start of its window,
    how many of them the cache holds, how many it has generated."""

    def __init__(self, seq):
        self.seq, self.tokens, self.generated = seq, list(seq.prompt_ids), 0
        self.position = 0


class Engine:
    """Continuous batching over `slots` rows of one KV cache, in a thread of its own.

    submit() queues sequences (QueueFull beyond `queue_limit` waiting); the thread
    admits them into free slots, samples and decodes all busy slots together, and
    calls each sequence's emit. JAX releases the GIL while it computes, so the HTTP
    server's event loop keeps serving meanwhile.
    """

    def __init__(self, model, slots, queue_limit, tp_devices=None):
        self.cfg = model.cfg
        self.graphdef, state = nnx.split(model)
        self.state = place_weights(state, tp_devices)
        self.window, self.vocab, self.n_slots, self.queue_limit = model.cfg.seq_len, model.cfg.vocab_size, slots, queue_limit
        self.buckets = prefill_buckets(self.window)
        self.cache = init_cache(model.cfg, slots, self.window)
        padded_vocab = model.embed_VD[...].shape[0]
        self.logits_SV = jnp.zeros((slots, padded_vocab), jnp.float32)
        self.key_data_S2 = np.zeros((slots, 2), np.uint32)
        self.slots = [None] * slots
        self.waiting = collections.deque()
        self.wakeup = threading.Condition()
        self.stopping = False
        self.thread = None

    # --- the outside -------------------------------------------------------

    def submit(self, seqs):
        """Queue sequences together, or none of them (QueueFull)."""
        with self.wakeup:
            if len(self.waiting) + len(seqs) > self.queue_limit + self.free_slots():
                raise QueueFull(f"{len(self.waiting)} sequences are already waiting for a slot (--serve.queue {self.queue_limit})")
            self.waiting.extend(seqs)
            self.wakeup.notify()

    def free_slots(self):
        return sum(s is None for s in self.slots)

    def busy(self):
        with self.wakeup:
            return self.n_slots - self.free_slots(), len(self.waiting)

    def start(self):
        self.warm_up()
        self.thread = threading.Thread(target=self.run, name="engine", daemon=True)
        self.thread.start()

    def stop(self):
        with self.wakeup:
            self.stopping = True
            self.wakeup.notify()
        if self.thread is not None:
            self.thread.join()

    def warm_up(self):
        """Compile every prefill bucket, the sampling step and the decode step now, so
        that no request waits for a compile."""
        for bucket in self.buckets:
            self.prefill(0, [0] * bucket)
        self.sample()
        self.decode(np.zeros(self.n_slots, np.int32), np.zeros(self.n_slots, np.int32))
        jax.block_until_ready(self.logits_SV)

    # --- the compiled steps ------------------------------------------------

    def prefill(self, slot, ids):
        """Prefill `ids` (at most one window) into `slot`; returns the per-position
        prompt log-probabilities (device arrays, length padded to the bucket)."""
        bucket = next(b for b in self.buckets if b >= len(ids))
        tokens_1T = jnp.asarray([list(ids) + [0] * (bucket - len(ids))], jnp.int32)
        self.cache, self.logits_SV, prompt = prefill_slot(self.graphdef, self.vocab, self.state, self.cache, self.logits_SV,
                                                          tokens_1T, jnp.int32(len(ids)), jnp.int32(slot))
        return prompt

    def sample(self):
        settings = [(s.seq.temperature, s.seq.top_k, s.seq.top_p) if s else (0.0, 0, 1.0) for s in self.slots]
        temperature_S, top_k_S, top_p_S = (np.asarray(column, dtype) for column, dtype in
                                           zip(zip(*settings), (np.float32, np.int32, np.float32)))
        out = sample_slots(self.vocab, self.logits_SV, self.key_data_S2, temperature_S, top_k_S, top_p_S)
        token_S, self.key_data_S2, logprob_S, top_id_SN, top_logprob_SN = jax.device_get(out)
        self.key_data_S2 = np.array(self.key_data_S2)
        return token_S, logprob_S, top_id_SN, top_logprob_SN

    def decode(self, tokens_S, positions_S):
        self.cache, self.logits_SV = decode_slots(self.graphdef, self.state, self.cache, jnp.asarray(tokens_S, jnp.int32),
                                                  jnp.asarray(positions_S, jnp.int32))

    # --- the loop ----------------------------------------------------------

    def run(self):
        while True:
            with self.wakeup:
                while not self.stopping and not self.waiting and self.free_slots() == self.n_slots:
                    self.wakeup.wait()
                if self.stopping:
                    break
            try:
                self.admit()
                if any(self.slots):
                    self.step()
            except Exception as e:  # never die silently: fail the sequences in flight, keep serving
                traceback.print_exc()
                for i, slot in enumerate(self.slots):
                    if slot is not None:
                        self.finish(i, f"error: {type(e).__name__}: {e}")
                self.cache = init_cache(self.cfg, self.n_slots, self.window)  # a failed step may have consumed it (donated)
                self.logits_SV = jnp.zeros_like(self.logits_SV)
        for i, slot in enumerate(self.slots):
            if slot is not None:
                self.finish(i, "cancelled")
        for seq in self.waiting:
            seq.emit(("done", "cancelled"))

    def admit(self):
        """Waiting sequences take free slots: a fresh key and a prefill each. Cancelled
        ones (their client went away) leave the queue at once, slots free or not."""
        with self.wakeup:
            cancelled = [seq for seq in self.waiting if seq.cancelled]
            if cancelled:
                self.waiting = collections.deque(seq for seq in self.waiting if not seq.cancelled)
        for seq in cancelled:
            seq.emit(("done", "cancelled"))
        for i in range(self.n_slots):
            if self.slots[i] is not None:
                continue
            with self.wakeup:  # submit() counts free slots under the same lock
                if not self.waiting:
                    return
                seq = self.waiting.popleft()
                if seq.cancelled:
                    seq.emit(("done", "cancelled"))
                    continue
                slot = self.slots[i] = Slot(seq)
            self.key_data_S2[i] = key_data(seq.seed)
            prompt = self.prefill(i, slot.tokens)
            slot.position = len(slot.tokens)
            if seq.want_prompt_logprobs:
                n = len(slot.tokens)
                seq.emit(("prompt", *(np.asarray(a)[:n] for a in jax.device_get(prompt))))
            if seq.max_tokens == 0:
                self.finish(i, "length")

    def step(self):
        """Sample every busy slot's next token, hand it out, then decode them all."""
        token_S, logprob_S, top_id_SN, top_logprob_SN = self.sample()
        tokens_S, positions_S, restarts = np.zeros(self.n_slots, np.int32), np.zeros(self.n_slots, np.int32), []
        for i, slot in enumerate(self.slots):
            if slot is None:
                continue
            if slot.seq.cancelled:
                self.finish(i, "cancelled")
                continue
            token = int(token_S[i])
            slot.tokens.append(token)
            slot.generated += 1
            slot.seq.emit(("token", token, float(logprob_S[i]), top_id_SN[i], top_logprob_SN[i]))
            if slot.generated >= slot.seq.max_tokens:
                self.finish(i, "length")
            elif slot.position == self.window:  # the window is full: restart from its last half (main.generate)
                restarts.append(i)
            else:
                tokens_S[i], positions_S[i] = token, slot.position
                slot.position += 1
        if any(self.slots):
            self.decode(tokens_S, positions_S)  # restarting rows decode a dummy; their prefill replaces the row
        for i in restarts:
            slot = self.slots[i]
            slot.tokens = slot.tokens[-(self.window // 2):]
            self.prefill(i, slot.tokens)
            slot.position = len(slot.tokens)

    def finish(self, i, reason):
        with self.wakeup:
            seq, self.slots[i] = self.slots[i].seq, None
        seq.emit(("done", reason))
