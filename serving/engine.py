"""Continuous batching for the server: sequences come and go over the rows ("slots")
of one sampling.Decoder, driven by a thread of its own.

Every iteration, one compiled step samples the next token of every busy slot and one
compiled decode step runs them all through the model (runtime/sampling.py). A sequence that
finishes frees its slot and a waiting one takes it at the next iteration. Every slot
decodes exactly as `--mode sample` does (sampling.generate is a one-slot Decoder), so a
greedy completion here is the text `--mode sample --sample.temperature 0` prints, and a
seeded sample the one `--mode sample --sample.seed S` prints.

The engine deals in token ids; serve.py turns them into text, stop strings and HTTP.
"""

import collections
import functools
import threading
import traceback

import jax
import numpy as np

from runtime.sampling import Decoder, bias_row

# ---- Sequences and the engine


@functools.partial(jax.jit, donate_argnums=0)
def set_row(bias_SV, slot, bias_V):
    """Row `slot` of the logit bias becomes bias_V (a guided slot's mask each step; min_tokens' ban on the ends)."""
    return bias_SV.at[slot].set(bias_V)


class QueueFull(Exception):
    """More sequences are waiting than --serve.queue allows."""


class Sequence:
    """One prompt's generation: its settings, and `emit`, called from the engine's
    thread with ("prompt", next_logprob_T, top_id_TN, top_logprob_TN) after the prefill
    (only with want_prompt_logprobs), ("token", id, logprob, top_id_N, top_logprob_N)
    per token, and last ("done", "length" | "cancelled" | "error: ...").
    `penalties`: sampling.Decoder.start's frequency_penalty, presence_penalty and
    logit_bias ({token id: bias}), min_p and repetition_penalty. `guide`: a structured.Guide whose
    mask every token obeys. The first `min_tokens` tokens are none of `end_ids` (vLLM's min_tokens)."""

    def __init__(self, prompt_ids, max_tokens, temperature, top_k, top_p, seed, emit, want_prompt_logprobs=False, guide=None,
                 min_tokens=0, end_ids=(), **penalties):
        self.prompt_ids, self.max_tokens, self.emit, self.guide = list(prompt_ids), max_tokens, emit, guide
        self.min_tokens, self.end_ids = min_tokens, sorted(end_ids)
        self.temperature, self.top_k, self.top_p, self.seed = temperature, top_k, top_p, seed
        self.penalties = penalties
        self.want_prompt_logprobs = want_prompt_logprobs
        self.cancelled = False  # set from any thread; the engine frees the slot at its next step
        self.engine = None  # the engine it was submitted to

    def bias_row(self, generated, vocab):
        """The logit bias of this sequence's next token when it is not the one it had (None): a guide's mask at every
        token, else the request's logit_bias with the ends banned at the first token, and lifted at the min_tokens-th."""
        if self.guide is not None:
            row_V = self.guide.bias_row(self.max_tokens - generated)
        elif generated in (0, self.min_tokens) and self.min_tokens > 0:
            row_V = bias_row(self.penalties.get("logit_bias"), vocab)
        else:
            return None
        if generated < self.min_tokens:
            row_V[[t for t in self.end_ids if t < vocab]] = -np.inf
        return row_V

    def cancel(self):
        """From any thread: a waiting sequence leaves the queue now (it is "done",
        "cancelled"); a running one frees its slot at the engine's next step."""
        self.cancelled = True
        if self.engine is not None:
            self.engine.drop_waiting(self)


class Slot:
    """A sequence in a slot, and how many tokens it has generated (where it stands in
    the cache: the decoder's row of the same index)."""

    def __init__(self, seq):
        self.seq, self.generated = seq, 0


class Engine:
    """Continuous batching over `slots` rows of one KV cache, in a thread of its own.

    submit() queues sequences (QueueFull beyond `queue_limit` waiting); the thread
    admits them into free slots, samples and decodes all busy slots together, and
    calls each sequence's emit. JAX releases the GIL while it computes, so the HTTP
    server's event loop keeps serving meanwhile.
    """

    def __init__(self, model, slots, queue_limit, tp_devices=None):
        self.metrics = None  # a metrics.Metrics the loop reports to, once the app sets it
        self.decoder = Decoder(model, slots, tp_devices)
        self.window, self.buckets, self.n_slots, self.queue_limit = self.decoder.window, self.decoder.buckets, slots, queue_limit
        self.vocab = self.decoder.vocab  # the token ids it samples (logit_bias may name any of them)
        self.slots = [None] * slots
        self.waiting = collections.deque()
        self.wakeup = threading.Condition()
        self.stopping = False
        self.thread = None
        self.ready = threading.Event()  # set once every program is compiled and the loop runs

    # --- the outside -------------------------------------------------------

    def submit(self, seqs):
        """Queue sequences together, or none of them (QueueFull)."""
        with self.wakeup:
            if len(self.waiting) + len(seqs) > self.queue_limit + self.free_slots():
                raise QueueFull(f"{len(self.waiting)} sequences are already waiting for a slot (--serve.queue {self.queue_limit})")
            for seq in seqs:
                seq.engine = self
                if self.metrics is not None:
                    self.metrics.submitted(seq)
            self.waiting.extend(seqs)
            self.wakeup.notify()

    def drop_waiting(self, seq):
        """Take a cancelled sequence out of the queue at once, not at the loop's next
        iteration: that may be a long step (or, while loading, a compile) away, and
        meanwhile /health would count a client that has gone."""
        with self.wakeup:
            try:
                self.waiting.remove(seq)
            except ValueError:
                return  # running (its slot is freed at the next step) or done
        seq.emit(("done", "cancelled"))

    def free_slots(self):
        return sum(s is None for s in self.slots)

    def busy(self):
        with self.wakeup:
            return self.n_slots - self.free_slots(), len(self.waiting)

    def start(self):
        """Compile every step now (no request waits for a compile), then serve.
        Sequences submitted meanwhile wait in the queue."""
        self.decoder.warm_up()
        self.decoder.bias_SV = set_row(self.decoder.bias_SV, np.int32(0), np.zeros(self.vocab, np.float32))  # compiled now too
        self.thread = threading.Thread(target=self.run, name="engine", daemon=True)
        self.thread.start()
        self.ready.set()

    def stop(self):
        with self.wakeup:
            self.stopping = True
            self.wakeup.notify()
        if self.thread is not None:
            self.thread.join()

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
                self.decoder.reset()  # a failed step may have consumed the cache (donated)
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
                self.slots[i] = Slot(seq)
            if self.metrics is not None:
                self.metrics.admitted(seq)
            prompt = self.decoder.start(i, seq.prompt_ids, seq.seed, seq.temperature, seq.top_k, seq.top_p, **seq.penalties)
            if seq.want_prompt_logprobs:
                n = len(seq.prompt_ids)
                seq.emit(("prompt", *(np.asarray(a)[:n] for a in jax.device_get(prompt))))
            if seq.max_tokens == 0:
                self.finish(i, "length")

    def step(self):
        """Sample every busy slot's next token (guided ones within their masks, min_tokens' without their ends), hand it out,
        then decode them all."""
        for i, slot in enumerate(self.slots):
            row_V = None if slot is None else slot.seq.bias_row(slot.generated, self.vocab)
            if row_V is not None:
                self.decoder.bias_SV = set_row(self.decoder.bias_SV, np.int32(i), row_V)
        token_S, logprob_S, top_id_SN, top_logprob_SN = self.decoder.sample()
        for i, slot in enumerate(self.slots):
            if slot is None:
                continue
            if slot.seq.cancelled:
                self.finish(i, "cancelled")
                continue
            token = int(token_S[i])
            slot.generated += 1
            if slot.seq.guide is not None:
                slot.seq.guide.take(token)
            if self.metrics is not None:
                self.metrics.token(slot.seq)
            slot.seq.emit(("token", token, float(logprob_S[i]), top_id_SN[i], top_logprob_SN[i]))
            if slot.generated >= slot.seq.max_tokens:
                self.finish(i, "length")
            elif token in slot.seq.end_ids:  # (here, not by the reader's cancel: one more step would sample a token no one reads)
                self.finish(i, "stop")
        self.decoder.advance(token_S)  # the slots still busy take their token

    def finish(self, i, reason):
        with self.wakeup:
            seq, self.slots[i] = self.slots[i].seq, None
        self.decoder.free(i)
        seq.emit(("done", reason))
