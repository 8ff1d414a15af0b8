"""Supervised fine-tuning (--train.objective sft): the loss counts the assistant's tokens
only, the step on packed rows equals a plain masked forward of the same conversations one
per row and one device on every mesh, and bad conversations are one-line errors (8 fake
CPU devices, float32)."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from data.conversations import as_row, open_conversations, packed_rows
from model import Transformer, unmasked
from ops.packing import document_starts, segment_ids
from parallel import objectives, optimizers
from parallel.mesh import batch_spec, global_batch, named, specs_of
from parallel.steps import executor_of, make_train_step, partition
from parallel.weights import param_specs
from test_context_parallel import MOMENT_RTOL
from test_parallel import RTOL, assert_params_close, assert_same_steps, initial_params, mesh_for, run_steps, tiny_config
from utils import Config, ConfigError, apply_overrides, parse_args


EOT = 0  # the padding's token


def sft_config(mesh_shape=(1, 1, 1), **train):
    cfg = apply_overrides(tiny_config(mesh_shape), {"train": dict(objective="sft", **train)})
    return apply_overrides(cfg, {"data": dict(conversations="plays")})


def sft_batch(cfg, seed=0):
    """(B rows of packed conversations, as data/conversations.packed_rows lays them out; the
    same conversations one per row [N, T+1], as_row's layout). A conversation of 3..T/2 + 1
    tokens: a prompt whose targets the loss skips (stored ~id), then a reply whose targets count."""
    B, T1 = cfg.train.batch_size, cfg.model.seq_len + 1
    rng = np.random.default_rng(seed)
    conversations = []
    while True:  # (a row grows by one at most per conversation: B rows exactly)
        n = int(rng.integers(3, T1 // 2 + 1))
        conversation = (rng.integers(1, cfg.model.vocab_size, n).astype(np.int32), np.arange(n) >= rng.integers(1, n - 1))
        if len(packed_rows(conversations + [conversation], T1, EOT)) > B:
            break
        conversations.append(conversation)
    return packed_rows(conversations, T1, EOT), np.stack([as_row(ids, trained, T1, EOT) for ids, trained in conversations])


def sft_train_steps(cfg, tokens, n_steps=2):
    """train_steps (tests/test_parallel.py) on the SFT rows `tokens`."""
    mesh = mesh_for(cfg)
    graphdef, host_params = initial_params(cfg.model)
    params = jax.device_put(host_params, named(mesh, param_specs(host_params, cfg.mesh.expert_parallel)))
    optimizer = optimizers.make_optimizer(cfg.train)
    opt_state = optimizers.init_opt_state(optimizer, params, mesh)
    step = make_train_step(graphdef, cfg, mesh, optimizer, params, opt_state)
    batch = global_batch(mesh, tokens, cfg.train.batch_size)
    return run_steps(step, params, opt_state, batch, n_steps)


# ---- The loss head: a skipped target's label changes nothing


def test_skipped_labels_change_no_gradient():
    """head_sums (every executor's loss head) with the same hidden states: relabelling
    every skipped target (prompt, padding) leaves the loss and every gradient bit for bit;
    relabelling one counted target moves them."""
    cfg = sft_config()
    graphdef, host_params = initial_params(cfg.model)
    tokens = sft_batch(cfg)[0]
    trained = tokens >= 0
    y_BTD = jax.random.normal(jax.random.key(1), (tokens.shape[0], cfg.model.seq_len, cfg.model.d_model))

    def head(params, y_BTD, tokens_BT1):  # (the angles matter only to MTP and cp: neither here)
        return nnx.merge(graphdef, params).head_sums(y_BTD, tokens_BT1, None)[0]

    grad_of = jax.jit(jax.value_and_grad(head, argnums=(0, 1)))
    ce, grads = grad_of(host_params, y_BTD, tokens)
    relabelled = np.where(trained, tokens, ~((unmasked(tokens) + 7) % cfg.model.vocab_size))
    assert (relabelled != tokens).sum() > tokens.size // 3  # premise: most labels changed
    ce2, grads2 = grad_of(host_params, y_BTD, relabelled)
    assert float(ce) == float(ce2)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads2)):
        np.testing.assert_array_equal(a, b)
    b, t = np.argwhere(trained[:, 1:])[0]
    counted = tokens.copy()
    counted[b, t + 1] = (counted[b, t + 1] + 1) % cfg.model.vocab_size
    ce3, grads3 = grad_of(host_params, y_BTD, counted)
    assert float(ce3) != float(ce) and not np.array_equal(grads3[1], grads[1])


# ---- The step against a plain masked reference, and on a mesh against one device


def reference_loss(model, tokens_BT1, cfg):
    """The plain single-device forward: mean cross-entropy over the counted targets, plus
    the balance loss, the whole scaled as parallel/objectives.py says."""
    inputs, targets = unmasked(tokens_BT1[:, :-1]), tokens_BT1[:, 1:]
    logits_BTV, stats_N = model(inputs)
    logp_BT = jnp.take_along_axis(jax.nn.log_softmax(logits_BTV, axis=-1), unmasked(targets)[..., None], -1)[..., 0]
    count = jnp.sum(targets >= 0)
    ce = -jnp.sum(jnp.where(targets >= 0, logp_BT, 0.0)) / count
    n_moe = cfg.model.n_blocks * cfg.model.block_pattern.count("M")
    aux = jnp.sum(stats_N["aux_loss_sum"]) / (tokens_BT1.shape[0] * n_moe)
    return ce + cfg.model.aux_loss_weight * aux * targets.size / count, ce


def packed_config(overrides):
    """sft_config and `overrides` ({section: {field: value}}) with nothing that tells a packed row from its
    conversations one per row: dropless experts (capacity is per row) and no balance loss (a mean over rows)."""
    return apply_overrides(apply_overrides(sft_config(), {"model": dict(capacity_factor=0.0, aux_loss_weight=0.0)}), overrides)


def step_loss_and_grads(cfg, tokens):
    """The step's loss and gradients on cfg's mesh: its executor's, rescaled by objectives.per_target."""
    mesh = mesh_for(cfg)
    graphdef, host_params = initial_params(cfg.model)
    params = jax.device_put(host_params, named(mesh, param_specs(host_params, cfg.mesh.expert_parallel)))
    grads_of = executor_of(cfg)

    def loss_and_grads(params, tokens_bT1):
        (_, metrics), grads = grads_of.value_and_grad(params, tokens_bT1, graphdef, cfg, None)
        metrics, grads = objectives.per_target(metrics, grads, tokens_bT1, cfg)
        return metrics["loss"], grads

    specs = specs_of(params)
    return jax.device_get(jax.jit(partition(loss_and_grads, grads_of.MANUAL, mesh, (specs, batch_spec()), (jax.P(), specs)))(
        params, global_batch(mesh, tokens, cfg.train.batch_size)))


PACKED_CASES = {
    "one-device": {},
    "dp2xtp2-accumulate": dict(mesh=dict(dp=2, tp=2), train=dict(microbatches=2)),
    "dot_product_attention": dict(model=dict(attention="dot_product_attention")),
    "blockwise": dict(model=dict(attention="blockwise", attention_block=8)),
    "cp2-blockwise": dict(mesh=dict(cp=2), model=dict(attention="blockwise", attention_block=4, routing_group=4)),
    "mtp": dict(model=dict(mtp_depth=1, mtp_loss_weight=0.3)),
    "pp2-zbv": dict(mesh=dict(pp=2), train=dict(pipeline="zbv", microbatches=4)),
    "auto-dp2xtp2": dict(mesh=dict(dp=2, tp=2, sharding="auto")),
    "cp2-splash": dict(mesh=dict(cp=2), model=dict(attention="splash", seq_len=512, routing_group=128, n_blocks=2),
                       train=dict(batch_size=2)),
}
SLOW_CASES = ("pp2-zbv", "auto-dp2xtp2", "cp2-splash", "blockwise", "cp2-blockwise")


@pytest.mark.parametrize("case", [pytest.param(c, marks=[pytest.mark.slow] if c in SLOW_CASES else []) for c in PACKED_CASES])
def test_packed_rows_train_what_their_conversations_train_one_per_row(case):
    """The step's loss (the mean over the replies' tokens) and gradients on packed rows equal
    the plain forward's (matmul attention, one device; its loss reads the counted targets
    only) on the same conversations one per row. MTP: the one-device step's on them."""
    cfg = packed_config(PACKED_CASES[case])
    packed, alone = sft_batch(cfg, seed=2)
    assert len(alone) >= 2 * len(packed)  # premise: rows hold two conversations or more
    loss, grads = step_loss_and_grads(cfg, packed)
    one_device = packed_config({"model": dict(cfg.model.__dict__), "train": dict(batch_size=len(alone))})
    if cfg.model.mtp_depth:  # (the plain forward has no MTP head)
        ref_loss, ref_grads = step_loss_and_grads(one_device, alone)
    else:
        plain = dataclasses.replace(one_device.model, attention="matmul")
        graphdef, host_params = initial_params(plain)
        (_, ref_loss), ref_grads = jax.jit(jax.value_and_grad(
            lambda p: reference_loss(nnx.merge(graphdef, p), jnp.asarray(alone), one_device), has_aux=True))(host_params)
    np.testing.assert_allclose(loss, ref_loss, rtol=RTOL)
    assert_params_close(grads, jax.device_get(ref_grads))


@pytest.fixture(scope="module")
def one_device():
    cfg = sft_config()
    return sft_train_steps(cfg, sft_batch(cfg)[0])


@pytest.mark.parametrize("mesh_shape, train", [((2, 1, 2), {}), ((2, 2, 2), {}),
                                               pytest.param((1, 2, 1), dict(pipeline="1f1b", microbatches=4), marks=pytest.mark.slow)],
                         ids=["dp2xtp2", "dp2xpp2xtp2", "pp2-1f1b"])
def test_sft_two_steps_equal_one_device(one_device, mesh_shape, train):
    cfg = apply_overrides(sft_config(mesh_shape), {"train": train})
    assert_same_steps(sft_train_steps(cfg, sft_batch(cfg)[0]), one_device)


@pytest.mark.slow
def test_sft_two_steps_under_context_parallel_equal_one_device():
    cfg = apply_overrides(sft_config(), {"mesh": dict(cp=2), "model": dict(routing_group=4)})
    reference = sft_train_steps(apply_overrides(sft_config(), {"model": dict(routing_group=4)}), sft_batch(cfg)[0])
    # cp's tolerance (test_context_parallel.MOMENT_RTOL: AdamW's nu 1.2e-5 off on an AMD EPYC; a lost chunk moves it ~0.5)
    assert_same_steps(sft_train_steps(cfg, sft_batch(cfg)[0]), reference, rtol=MOMENT_RTOL)


# ---- Conversations: the plays, and bad data as one line each


def write_jsonl(path, conversations):
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations))
    return str(path)


def conversations_config(source, template="", seq_len=128):
    cfg = apply_overrides(Config(), {"train": dict(objective="sft"), "data": dict(conversations=source),
                                     "serve": dict(chat_template=template)})
    return apply_overrides(cfg, {"model": dict(seq_len=seq_len)})


def test_play_conversations_train_the_reply_and_its_end_only():
    """Each conversation of a packed row (two here): the prompt, then the reply and the
    end-of-text token, the only counted targets."""
    data = open_conversations(conversations_config("plays"))
    rows = data.batch("train", 0, 64, 128, seed=0)
    row = rows[np.asarray(segment_ids(rows)).max(axis=1) == 2][0]
    for conversation in np.split(row, np.flatnonzero(document_starts(row))[1:]):
        text = bytes(unmasked(conversation)[unmasked(conversation) < 256].astype(np.uint8)).decode()
        assert text.startswith("USER:\n") and "\n\nASSISTANT:\n" in text
        reply = text.split("ASSISTANT:\n", 1)[1]
        counted = conversation[conversation >= 0]
        assert bytes(counted[:-1].astype(np.uint8)).decode() == reply and counted[-1] == 256  # the reply, then end-of-text
    assert len(data.rows["val"]) > 100 and len(data.rows["train"]) > 10 * len(data.rows["val"])
    np.testing.assert_array_equal(data.batch("train", 3, 4, 128, seed=0), data.batch("train", 3, 4, 128, seed=0))


REFUSING = ("{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
            "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}")


@pytest.mark.parametrize("messages, message", [
    ([{"role": "user", "content": "hi"}], "no assistant message"),
    ([{"role": "user", "content": "hi " * 60}, {"role": "assistant", "content": "ho"}], r"more than --model.seq_len \+ 1"),
    ([{"role": "narrator", "content": "hi"}, {"role": "assistant", "content": "ho"}], "refuses it: unknown role narrator"),
], ids=["no-assistant", "too-long", "refused-role"])
def test_bad_conversations_are_one_line_errors(tmp_path, messages, message):
    template = tmp_path / "chat.jinja"
    template.write_text(REFUSING)
    good = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ho"}]
    path = write_jsonl(tmp_path / "c.jsonl", [good, good, messages])
    with pytest.raises(ConfigError, match=message) as error:
        open_conversations(conversations_config(path, str(template)))
    assert "c.jsonl line 3" in str(error.value) and "\n" not in str(error.value)


def test_sft_flags_are_checked():
    with pytest.raises(ConfigError, match="--data.conversations"):
        parse_args(["--train.objective", "sft"])
    with pytest.raises(ConfigError, match="must be lm, or sft"):
        parse_args(["--train.objective", "dpo", "--data.conversations", "plays"])
    assert parse_args(["--train.objective", "sft", "--data.conversations", "plays"]).train.objective == "sft"


# ---- An imported DeepSeek-V3 checkpoint, fine-tuned on chats, back to transformers


@pytest.mark.slow
def test_an_imported_deepseek_v3_fine_tuned_on_chats_exports_to_transformers_with_our_logits(tmp_path):
    """A random DeepseekV3 made and saved by transformers, with a ChatML template: fine-tuned 3 SFT
    steps from hf:DIR on a JSONL of chats (its template renders them), exported in float32,
    transformers' logits of a rendered chat equal ours from the run's checkpoint (1e-5), and
    differ from the base model's (the steps moved it)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from runtime.sampling import host_params
    from serving.modes import load_run_params
    from test_hf import command_line, hf_made_model
    from test_openai import write_chat_tokenizer

    base = str(tmp_path / "base")
    hf_made_model(base, first_k_dense=1, n_layers=2, seed=5)
    write_chat_tokenizer(base)
    chats = [[{"role": "user", "content": f"Count to {n}."}, {"role": "assistant", "content": " ".join(map(str, range(1, n + 1)))}]
             for n in range(2, 10)]
    run = command_line(tmp_path)
    args = ("--run.name", "sft", "--model.seq_len", "64", "--train.init_from", f"hf:{base}", "--train.objective", "sft",
            "--data.conversations", write_jsonl(tmp_path / "chats.jsonl", chats * 3), "--train.steps", "3", "--train.batch_size", "4",
            "--train.eval_every", "1000", "--sample.num_samples", "0")
    run(*args)
    run("--mode", "export_hf", "--run.name", "sft", "--export.dtype", "float32")

    tokenizer = transformers.AutoTokenizer.from_pretrained(base)
    ids = tokenizer.apply_chat_template(chats[3], tokenize=True, return_dict=False)
    with torch.no_grad():
        theirs_TV = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "runs" / "sft" / "hf"))(torch.tensor([ids])).logits[0]
        base_TV = transformers.AutoModelForCausalLM.from_pretrained(base)(torch.tensor([ids])).logits[0]
    cfg = parse_args(["--preset", "tiny", "--run.out_dir", str(tmp_path / "runs"), *args[:2], "--run.cpu_devices", "1"])
    cfg, _, params = load_run_params(cfg)
    dropless = dataclasses.replace(cfg.model, capacity_factor=0.0)  # transformers' MoE drops no token
    graphdef = nnx.split(nnx.eval_shape(lambda: Transformer(dropless, nnx.Rngs(0))))[0]
    ours_TV = np.asarray(nnx.merge(graphdef, host_params(params))(jnp.asarray([ids]))[0][0])
    np.testing.assert_allclose(theirs_TV.numpy(), ours_TV[:, :theirs_TV.shape[1]], atol=1e-5, rtol=0)
    assert np.abs(theirs_TV - base_TV).max() > 1e-2
