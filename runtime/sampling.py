"""The one sampler: `--mode sample`, the samples after training and the server's engine (serving/engine.py) all decode
through Decoder: rows ("slots") of one latent KV cache, each with its own settings, logit bias and key. A row's window is
seq_len; when full, it restarts from its last half window, so a sequence depends only on its prompt, settings and seed
(`--mode sample` prints what the server returns). The model runs on one device, or split over tp_devices (place_weights)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from dataset import get_tokenizer
from model import decode_step, init_cache
from parallel import weights
from utils import TP

MIN_PREFILL_BUCKET = 16  # shorter prompts are padded to this: one compile covers them all
TOP_LOGPROBS = 5  # alternatives computed at every position (OpenAI's API allows up to 5)


def prefill_buckets(window):
    """Prompt lengths prefill compiles for: powers of two from MIN_PREFILL_BUCKET, and the window. Padding goes after the
    prompt: causal attention keeps it out of the prompt's logits, and its cache slots are overwritten before any query sees them."""
    return [MIN_PREFILL_BUCKET << k for k in range(window.bit_length()) if MIN_PREFILL_BUCKET << k < window] + [window]


# ---- The compiled pieces (graphdef and shapes are static; each compiles once per shape)


def real_vocab_only(logprobs_XV, vocab):
    """Padded vocabulary entries are no tokens: never offered as alternatives."""
    return jnp.where(jnp.arange(logprobs_XV.shape[-1]) < vocab, logprobs_XV, -jnp.inf)


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(3, 4))
def prefill_slot(graphdef, vocab, state, cache, logits_SV, tokens_1T, length, slot):
    """Prefill one prompt (padded to T) into cache row `slot`, from a fresh row. Returns the cache, logits_SV with the slot's
    next-token logits (at length - 1), and per prompt position t the log-probability of token t+1 and the top alternatives
    (`echo`), from the log-softmax over the whole padded vocabulary, as the loss uses."""
    model = nnx.merge(graphdef, state)
    logits_1TV, row = decode_step(model, tokens_1T, init_cache(model.cfg, 1, cache[0][0].shape[2]), 0)
    cache = [(kv.at[:, slot].set(row_kv[:, 0]), rope.at[:, slot].set(row_rope[:, 0])) for (kv, rope), (row_kv, row_rope) in zip(cache, row)]
    logits_SV = logits_SV.at[slot].set(logits_1TV[0, length - 1])
    logprobs_TV = jax.nn.log_softmax(logits_1TV[0])
    next_logprob_T = jnp.take_along_axis(logprobs_TV, jnp.roll(tokens_1T[0], -1)[:, None], axis=-1)[:, 0]
    top_logprob_TN, top_id_TN = jax.lax.top_k(real_vocab_only(logprobs_TV, vocab), TOP_LOGPROBS)
    return cache, logits_SV, (next_logprob_T, top_id_TN, top_logprob_TN)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def decode_slots(graphdef, state, cache, tokens_S, positions_S):
    """One new token per slot, each at its own position: the next logits [S, V]."""
    logits_S1V, cache = decode_step(nnx.merge(graphdef, state), tokens_S[:, None], cache, positions_S)
    return cache, logits_S1V[:, 0]


def sample_row(key, last_V, temperature, top_k, top_p, min_p):
    """One row's token: temperature, then top_k (0 = all), then top_p (nucleus; 1 = off), then min_p (tokens less likely
    than min_p x the likeliest dropped; 0 = off), then sampling (transformers' order of warpers). Settings are arrays."""
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
    scaled_V = jnp.where(scaled_V - jnp.max(scaled_V) < jnp.log(min_p), -jnp.inf, scaled_V)  # p < min_p x p_max (log 0 = -inf)
    return jax.random.categorical(key, scaled_V)


def adjusted_logits(last_SV, counts_SV, bias_SV, frequency_S, presence_S, prompt_seen_SV, repetition_S):
    """The logits a row chooses from: vLLM's repetition_penalty (a prompt's or generated token's logit divided by it where
    positive, multiplied where negative), then OpenAI's penalties: + the token's bias (-100 bans it) - frequency x (times
    it was generated) - presence x (1 if it was). All off: the logits themselves, bit for bit."""
    rp_S1, repeated_SV = repetition_S[:, None], (prompt_seen_SV > 0) | (counts_SV > 0)
    last_SV = jnp.where(repeated_SV & (rp_S1 != 1), jnp.where(last_SV > 0, last_SV / rp_S1, last_SV * rp_S1), last_SV)
    penalty_SV = frequency_S[:, None] * counts_SV + presence_S[:, None] * (counts_SV > 0)
    return last_SV + bias_SV - penalty_SV


@functools.partial(jax.jit, static_argnums=0, donate_argnums=3)
def sample_slots(vocab, logits_SV, key_data_S2, counts_SV, bias_SV, prompt_seen_SV, settings_SX):
    """Per slot: the next token, new key data, the counts with it added, its log-probability and top alternatives. Greedy rows
    (temperature 0) take the argmax; sampled rows split their key per token (first half carries on, second draws).
    Reported log-probabilities are the model's own, before penalties and bias (as vLLM). Padded vocabulary: never sampled."""
    temperature_S, top_k_S, top_p_S, frequency_S, presence_S, min_p_S, repetition_S = settings_SX.T  # (Row.settings)
    choice_SV = adjusted_logits(logits_SV[:, :vocab], counts_SV, bias_SV, frequency_S, presence_S, prompt_seen_SV, repetition_S)
    keys_S2 = jax.vmap(jax.random.split)(jax.random.wrap_key_data(key_data_S2))
    sampled_S = jax.vmap(sample_row)(keys_S2[:, 1], choice_SV, temperature_S, top_k_S.astype(jnp.int32), top_p_S, min_p_S)
    token_S = jnp.where(temperature_S > 0, sampled_S, jnp.argmax(choice_SV, axis=-1))
    counts_SV = counts_SV.at[jnp.arange(token_S.shape[0]), token_S].add(1.0)
    logprobs_SV = jax.nn.log_softmax(logits_SV)
    logprob_S = jnp.take_along_axis(logprobs_SV, token_S[:, None], axis=-1)[:, 0]
    top_logprob_SN, top_id_SN = jax.lax.top_k(real_vocab_only(logprobs_SV, vocab), TOP_LOGPROBS)
    return token_S, jax.random.key_data(keys_S2[:, 0]), counts_SV, logprob_S, top_id_SN, top_logprob_SN


@functools.partial(jax.jit, donate_argnums=(0, 1, 2))
def start_row(counts_SV, bias_SV, prompt_seen_SV, slot, bias_V, prompt_seen_V):
    """Row `slot` starts a sequence: nothing generated yet, its own logit bias, its prompt's tokens (repetition_penalty's)."""
    return counts_SV.at[slot].set(0.0), bias_SV.at[slot].set(bias_V), prompt_seen_SV.at[slot].set(prompt_seen_V)


def place_weights(state, tp_devices=None):
    """The weights on one device, or split over tp_devices along weights.WEIGHTS' TP dims (the rest, and the latent KV cache,
    replicated; jit partitions the steps). Plain arrays first: a sharded array keeps its mesh's axis types."""
    plain = jax.tree.map(np.asarray, state.to_pure_dict())
    if not tp_devices or len(tp_devices) == 1:
        return nnx.State(jax.device_put(plain, (tp_devices or jax.devices())[0]))
    mesh = jax.make_mesh((len(tp_devices),), (TP,), axis_types=(AxisType.Auto,), devices=tp_devices)

    def sharding(path, leaf):
        name = weights.weight_name(path)
        dims = tuple(TP if d == TP else None for d in weights.row(name).dims)
        return NamedSharding(mesh, P(*((None,) * (leaf.ndim - len(dims)) + dims)))  # stacked: N leads

    return nnx.State(jax.device_put(plain, jax.tree_util.tree_map_with_path(sharding, plain)))


# ---- The decoder: rows of one cache, the window policy, the compiled steps


class Row:
    """One sequence in the cache: its tokens since its window (re)started, how many the cache holds, its sampling settings."""

    def __init__(self, tokens, settings):
        self.tokens, self.position, self.settings = list(tokens), len(tokens), settings


FREE_ROW = (0.0, 0, 1.0, 0.0, 0.0, 0.0, 1.0)  # a free row's dummy settings (as Decoder.start orders them): greedy, no penalty


def bias_row(logit_bias, vocab):
    """{token id: bias} -> the dense [vocab] row sample_slots adds to the logits."""
    bias_V = np.zeros(vocab, np.float32)
    for token, bias in (logit_bias or {}).items():
        bias_V[int(token)] = bias
    return bias_V


class Decoder:
    """`slots` rows of one latent KV cache over one model; not thread-safe. start() fills a free row, sample() picks every
    row's next token, advance() feeds them back (restarting full windows), free() empties a row."""

    def __init__(self, model, slots, tp_devices=None):
        self.cfg = model.cfg
        self.graphdef, state = nnx.split(model)
        self.state = place_weights(state, tp_devices)
        self.window, self.vocab, self.n_slots = model.cfg.seq_len, model.cfg.vocab_size, slots
        self.padded_vocab = model.embed_VD[...].shape[0]
        self.buckets = prefill_buckets(self.window)
        self.rows = [None] * slots
        self.reset()

    def reset(self):
        """A fresh cache and no rows (also after a failed step consumed the donated cache), placed where the steps' outputs
        are: jit compiles per input placement, so an uncommitted array would cost the first request a compile."""
        where = next(iter(jax.tree.leaves(self.state))).sharding
        if isinstance(where, NamedSharding):
            where = NamedSharding(where.mesh, P())
        self.cache = jax.device_put(init_cache(self.cfg, self.n_slots, self.window), where)
        self.logits_SV = jax.device_put(jnp.zeros((self.n_slots, self.padded_vocab), jnp.float32), where)
        self.key_data_S2 = np.zeros((self.n_slots, 2), np.uint32)
        self.counts_SV = jax.device_put(jnp.zeros((self.n_slots, self.vocab), jnp.float32), where)  # tokens generated
        self.bias_SV = jax.device_put(jnp.zeros((self.n_slots, self.vocab), jnp.float32), where)  # logit_bias
        self.prompt_seen_SV = jax.device_put(jnp.zeros((self.n_slots, self.vocab), jnp.float32), where)  # 1: in the prompt
        self.rows = [None] * self.n_slots

    def warm_up(self):
        """Compile every program a request runs, twice (the second on the first's outputs, as later requests run); then reset."""
        for _ in range(2):
            for bucket in self.buckets:
                self.start(0, [0] * bucket, seed=0, temperature=1.0, top_k=0)
                self.advance(self.sample()[0])
        jax.block_until_ready(self.logits_SV)
        self.reset()

    # --- rows ---------------------------------------------------------------

    def start(self, i, prompt_ids, seed, temperature, top_k, top_p=1.0, frequency_penalty=0.0, presence_penalty=0.0, logit_bias=None,
              min_p=0.0, repetition_penalty=1.0):
        """Row i takes a prompt (at most one window), a fresh key and its logit bias ({token id: bias}) and is prefilled.
        Returns prefill_slot's per-position prompt log-probabilities (device arrays, padded to the bucket)."""
        self.rows[i] = Row(prompt_ids, (temperature, top_k, top_p, frequency_penalty, presence_penalty, min_p, repetition_penalty))
        self.key_data_S2[i] = jax.random.key_data(jax.random.key(seed))
        prompt_seen_V = np.isin(np.arange(self.vocab), prompt_ids).astype(np.float32)
        self.counts_SV, self.bias_SV, self.prompt_seen_SV = start_row(self.counts_SV, self.bias_SV, self.prompt_seen_SV, jnp.int32(i),
                                                                      jnp.asarray(bias_row(logit_bias, self.vocab)), jnp.asarray(prompt_seen_V))
        return self.prefill(i, self.rows[i].tokens)

    def free(self, i):
        self.rows[i] = None

    def sample(self):
        """The next token of every row (free rows: a dummy greedy one), as host arrays: (token_S, logprob_S, top_id_SN, top_logprob_SN)."""
        settings_SX = np.asarray([row.settings if row else FREE_ROW for row in self.rows], np.float32)
        token_S, key_data_S2, self.counts_SV, *rest = sample_slots(self.vocab, self.logits_SV, self.key_data_S2, self.counts_SV,
                                                                   self.bias_SV, self.prompt_seen_SV, settings_SX)
        token_S, key_data_S2, logprob_S, top_id_SN, top_logprob_SN = jax.device_get((token_S, key_data_S2, *rest))
        self.key_data_S2 = np.array(key_data_S2)
        return token_S, logprob_S, top_id_SN, top_logprob_SN

    def advance(self, token_S):
        """Every busy row takes its token, all decoded at once at their positions; a row with a full window restarts from its last half."""
        tokens_S, positions_S, restarts = np.zeros(self.n_slots, np.int32), np.zeros(self.n_slots, np.int32), []
        for i, row in enumerate(self.rows):
            if row is None:
                continue
            row.tokens.append(int(token_S[i]))
            if row.position == self.window:
                restarts.append(i)
            else:
                tokens_S[i], positions_S[i] = token_S[i], row.position
                row.position += 1
        if any(self.rows):
            self.decode(tokens_S, positions_S)  # restarting rows decode a dummy; their prefill replaces the row
        for i in restarts:
            row = self.rows[i]
            row.tokens = row.tokens[-(self.window // 2):]
            self.prefill(i, row.tokens)
            row.position = len(row.tokens)

    # --- the compiled steps ------------------------------------------------

    def prefill(self, i, ids):
        bucket = next(b for b in self.buckets if b >= len(ids))
        tokens_1T = jnp.asarray([list(ids) + [0] * (bucket - len(ids))], jnp.int32)
        self.cache, self.logits_SV, prompt = prefill_slot(self.graphdef, self.vocab, self.state, self.cache, self.logits_SV,
                                                          tokens_1T, jnp.int32(len(ids)), jnp.int32(i))
        return prompt

    def decode(self, tokens_S, positions_S):
        self.cache, self.logits_SV = decode_slots(self.graphdef, self.state, self.cache, jnp.asarray(tokens_S, jnp.int32),
                                                  jnp.asarray(positions_S, jnp.int32))


# ---- One sequence at a time: --mode sample, the samples after training


def generate_ids(model, prompt_ids, max_tokens, temperature, top_k, seed, top_p=1.0, **penalties):
    """`max_tokens` ids continuing `prompt_ids` (its last window), as the server returns for
    the same prompt, settings and seed; `penalties`: Decoder.start's. End-of-text does not stop it."""
    decoder = Decoder(model, 1)
    decoder.start(0, prompt_ids[-decoder.window:], seed, temperature, top_k, top_p, **penalties)
    out = []
    while len(out) < max_tokens:
        token_S = decoder.sample()[0]
        out.append(int(token_S[0]))
        if len(out) < max_tokens:
            decoder.advance(token_S)
    return out


def generate(model, tokenizer, prompt, max_tokens, temperature, top_k, seed, top_p=1.0, **penalties):
    """`prompt` and its continuation as text (an empty prompt starts from end-of-text)."""
    ids = tokenizer.encode(prompt) or [tokenizer.eot_id]
    return prompt + tokenizer.decode(generate_ids(model, ids, max_tokens, temperature, top_k, seed, top_p, **penalties))


def host_params(params):
    """All weights on every process as plain arrays (for sampling on one device)."""
    return jax.tree.map(np.asarray, multihost_utils.process_allgather(params, tiled=True))


def samples_from_params(cfg, params, graphdef, n):
    """n samples of the --sample.* settings with seeds --sample.seed, +1, ... (as `--mode sample` prints)."""
    tokenizer = get_tokenizer(cfg.data.tokenizer, cfg.data.encoding_file)
    params = __import__("parallel.lora").lora.merged(params, cfg.train) if "lora" in params else params
    model = nnx.merge(graphdef, host_params(params))
    s = cfg.sample
    return [generate(model, tokenizer, s.prompt, s.max_tokens, s.temperature, s.top_k, s.seed + i,
                     frequency_penalty=s.frequency_penalty, presence_penalty=s.presence_penalty) for i in range(n)]
