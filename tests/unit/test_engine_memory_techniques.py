"""The memory techniques of LM training give the plain run's numbers: the chunked loss (SFT, DPO and GRPO log-probs
and their gradients equal the full logits'), padding-free packing (the padded batch's loss and gradients), and
gradient checkpointing (the same gradients, a fraction of the tensors kept for backward); the probe that decides
where each applies is right about today's architectures."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from core.adapters import AdapterConfig
from core.estimate import architecture, training_memory
from tests.tiny_llama import TODAYS, VARIANTS, build_tiny_decoder
from tests.unit.test_engine_chat_training import _config as chat_config
from tests.unit.test_engine_chat_training import one_thread  # noqa: F401 - torch on one thread
from tests.unit.test_engine_reinforcement import Recorder
from worker.engines.training import adapters, chat, token_loss
from worker.engines.training.chat import assistant_loss, train_chat
from worker.engines.training.chat_render import IGNORE, Rendered, collate
from worker.engines.training.dpo import sequence_logprobs
from worker.engines.training.packing import pack, saves_work
from worker.engines.training.rollouts import sample, token_logprobs
from worker.engines.training.token_loss import ChunkedLogprobs, OutputHead, probe

LORA = AdapterConfig(r=4, alpha=8, dropout=0.0, target_modules="all-linear")


@pytest.fixture(scope="module")
def decoders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("decoders")
    for name in [*VARIANTS, *TODAYS]:
        build_tiny_decoder(name, root / name)
    return {name: root / name for name in [*VARIANTS, *TODAYS]}


def _load(folder: Path, lora: bool = False) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(folder)
    return adapters.apply_adapter(model, LORA, "causal-lm") if lora else model


def _examples(lengths: list[int]) -> list[Rendered]:
    generator = torch.Generator().manual_seed(3)
    examples = []
    for n in lengths:
        ids = torch.randint(5, 300, (n,), generator=generator).tolist()
        labels = [IGNORE] * (n // 2) + ids[n // 2:]  # the second half is the "reply"
        examples.append(Rendered(ids, labels))
    return examples


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _assert_same_grads(ours: dict[str, torch.Tensor], plain: dict[str, torch.Tensor]) -> None:
    assert ours.keys() == plain.keys() and ours
    for name in plain:
        torch.testing.assert_close(ours[name], plain[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize(("softcap", "scale", "bias", "temperature"), [(None, 1.0, False, 1.0), (3.0, 2.0, True, 0.7)])
def test_chunked_logprobs_and_gradients_equal_the_full_logits(monkeypatch, softcap, scale, bias, temperature):
    monkeypatch.setattr(token_loss, "CHUNK_VALUES", 50 * 7)  # 7 rows a chunk: 23 rows take four chunks
    torch.manual_seed(0)
    weight = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    bias_ = torch.randn(50, dtype=torch.float64, requires_grad=True) if bias else None
    hidden = torch.randn(23, 16, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (23,))
    head = OutputHead(weight, bias_, scale=scale, softcap=softcap)
    upstream = torch.randn(23, dtype=torch.float64)
    inputs = [hidden, weight] + ([bias_] if bias_ is not None else [])

    ours = ChunkedLogprobs.apply(hidden, weight, bias_, targets, head, temperature)
    (ours.double() * upstream).sum().backward()
    ours_grads = [x.grad.clone() for x in inputs]
    for x in inputs:
        x.grad = None
    logits = torch.nn.functional.linear(hidden, weight, bias_) / scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    plain = torch.log_softmax(logits / temperature, -1).gather(1, targets[:, None])[:, 0]
    (plain * upstream).sum().backward()
    torch.testing.assert_close(ours.double(), plain, rtol=1e-5, atol=1e-5)
    for mine, x in zip(ours_grads, inputs, strict=True):
        torch.testing.assert_close(mine, x.grad, rtol=1e-4, atol=1e-5)


def test_the_probe_finds_each_architectures_output_layer_and_whether_rows_pack(decoders):
    found = {}
    for name, folder in decoders.items():
        model = _load(folder)
        found[name] = probe(model, model.config.vocab_size, device="cpu")
    # Every head is a plain linear layer as the model applies it: Granite's logit scaling and Gemma 2's soft-capping
    # are read from the config and reproduced, so all of them take the chunked loss.
    assert all(checks.head is not None for checks in found.values()), found
    assert found["granite"].head.scale == 2.0 and found["gemma2"].head.softcap == 3.0
    # gpt-oss runs eager attention with sink logits, whose mask ignores packed positions: it must not pack.
    assert {name for name, checks in found.items() if not checks.packs} == {"gpt_oss"}


@pytest.mark.parametrize("name", ["llama", "gemma2", "granite", "qwen3_moe"])
def test_sft_dpo_and_grpo_through_the_chunked_loss_equal_the_full_logits(decoders, name, monkeypatch):
    monkeypatch.setattr(token_loss, "CHUNK_VALUES", 700 * 5)  # several chunks even on these short rows
    model = _load(decoders[name], lora=True)
    checks = probe(model, model.config.vocab_size, device="cpu")
    assert checks.head is not None
    batch = collate(_examples([9, 14, 6]), pad_id=0)

    plain_loss = assistant_loss(model, None, **batch)
    plain_loss.backward()
    plain = _grads(model)
    loss = assistant_loss(model, checks, **batch)
    loss.backward()
    torch.testing.assert_close(loss, plain_loss, rtol=1e-5, atol=1e-6)
    _assert_same_grads(_grads(model), plain)

    plain_sums = sequence_logprobs(model, None, batch["input_ids"], batch["attention_mask"], batch["labels"])
    sums = sequence_logprobs(model, checks, batch["input_ids"], batch["attention_mask"], batch["labels"])
    torch.testing.assert_close(sums, plain_sums, rtol=1e-5, atol=1e-5)

    with torch.no_grad():
        rollouts = sample(model.eval(), [[5, 9, 17, 33], [7, 8]], [1, 2], max_new_tokens=4, temperature=0.7,
                          stop_ids=set(), pad_id=0)
    model.train()
    torch.testing.assert_close(token_logprobs(model, rollouts, 0.7, checks), token_logprobs(model, rollouts, 0.7),
                               rtol=1e-5, atol=1e-5)


def test_the_chunked_loss_keeps_no_tokens_by_vocab_tensor_for_backward(decoders, monkeypatch):
    """What it claims to save: the plain loss keeps [targets x vocab] values for backward (the logits of the positions
    with a target), the chunked one their hidden states instead; what else is kept is the same."""
    monkeypatch.setattr(token_loss, "CHUNK_VALUES", 700 * 5)
    model = _load(decoders["llama"], lora=True)
    checks = probe(model, model.config.vocab_size, device="cpu")
    batch = collate(_examples([40, 60, 50]), pad_id=0)
    targets, vocab = int((batch["labels"] != IGNORE).sum()), model.config.vocab_size

    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}  # kept, but held anyway

    def kept(chosen: token_loss.ModelChecks | None) -> list[int]:
        sizes: dict[int, int] = {}

        def keep(tensor: torch.Tensor) -> torch.Tensor:
            if tensor.untyped_storage().data_ptr() not in weights:
                sizes[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
            assistant_loss(model, chosen, **batch)
        return sorted(sizes.values())

    plain, chunked = kept(None), kept(checks)
    full = targets * vocab * 4  # fp32 logits of every position with a target (the plain loss selects those)
    assert max(plain) >= full > max(chunked)  # no [targets x vocab] tensor kept
    rows = targets * model.config.hidden_size * 4  # what it keeps instead: the targets' final hidden states
    assert sum(plain) - sum(chunked) == full - rows


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma3", "mixtral"])
def test_a_packed_micro_batch_gives_the_padded_loss_and_gradients(decoders, name):
    model = _load(decoders[name], lora=True)
    checks = probe(model, model.config.vocab_size, device="cpu")
    examples = _examples([30, 7, 12, 5])
    assert checks.packs and saves_work([len(e.input_ids) for e in examples], architecture(model.config.to_dict()))
    padded_loss = assistant_loss(model, checks, **collate(examples, pad_id=0))
    padded_loss.backward()
    padded = _grads(model)
    packed = pack(examples)
    assert packed["input_ids"].shape == (1, 54) and packed["position_ids"][0, 30:37].tolist() == list(range(7))
    packed_loss = assistant_loss(model, checks, **packed)
    packed_loss.backward()
    torch.testing.assert_close(packed_loss, padded_loss, rtol=1e-5, atol=1e-6)
    _assert_same_grads(_grads(model), padded)


def test_packing_is_chosen_only_where_it_saves_work():
    smollm2 = architecture({"model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576, "vocab_size": 49152,
                            "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3})
    assert saves_work([30, 7, 12, 5], smollm2)  # 54 tokens instead of 120; attention is a small part
    assert saves_work([600, 80, 100, 90], smollm2)  # 870 tokens instead of 2400
    assert not saves_work([2048, 2048, 2000], smollm2)  # little padding, and the packed row's attention is 3x
    assert saves_work([4000, 100], smollm2)  # half the tokens and half the attention pairs (16.8M against 32M)
    assert not saves_work([16, 16, 16], smollm2)  # nothing padded: nothing to save
    assert not saves_work([12], smollm2) and not saves_work([30, 7], None)


def test_gradient_checkpointing_gives_the_same_gradients_and_keeps_a_fraction(decoders):
    model = _load(decoders["llama"], lora=True)
    checks = probe(model, model.config.vocab_size, device="cpu")
    batch = collate(_examples([40, 33]), pad_id=0)

    def step() -> tuple[dict[str, torch.Tensor], int]:
        kept: dict[int, int] = {}

        def keep(tensor: torch.Tensor) -> torch.Tensor:
            kept[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
            loss = assistant_loss(model, checks, **batch)
        loss.backward()
        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        return _grads(model), sum(size for pointer, size in kept.items() if pointer not in weights)

    model.train()
    plain, plain_bytes = step()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ours, ours_bytes = step()
    _assert_same_grads(ours, plain)
    # The estimate's claim for these shapes, against what autograd actually kept (weights aside).
    arch = architecture(model.config.to_dict())
    kwargs = {"head": "causal-lm", "batch_size": 2, "seq_len": 40, "precision": "fp32", "chunked_loss": True}
    claimed = (training_memory(arch, checkpointing=True, **kwargs).activations_bytes /
               training_memory(arch, checkpointing=False, **kwargs).activations_bytes)
    assert ours_bytes < 0.5 * plain_bytes and ours_bytes / plain_bytes < 2 * claimed, (ours_bytes, plain_bytes, claimed)


def _varied_chats() -> list[dict]:
    # Replies of eight lengths apart: even length-grouped micro-batches of four hold padding that packing saves.
    words = "the sky is blue because air scatters the short waves of light more than the long ones".split()
    return [{"messages": [{"role": "user", "content": f"Question {i}?"},
                          {"role": "assistant", "content": " ".join(words[:1 + 2 * i])}]} for i in range(8)]


def test_an_sft_run_packs_where_it_saves_work_with_the_padded_runs_losses(tmp_path, decoders, monkeypatch):
    from transformers import AutoTokenizer

    base = tmp_path / "chat-base"
    model = _load(decoders["llama"])
    model.save_pretrained(base)
    tokenizer = AutoTokenizer.from_pretrained(decoders["llama"])
    tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
                               "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
    tokenizer.save_pretrained(base)
    common = {"batch_size": 4, "max_steps": 4}
    runs = {}
    for name in ("packed", "padded"):
        if name == "padded":
            monkeypatch.setattr(chat, "saves_work", lambda lengths, arch: False)
        (tmp_path / name).mkdir()
        runs[name] = Recorder()
        result = train_chat(chat_config(tmp_path / name, base, _varied_chats(), **common), runs[name])
        memory = result.manifest["hyperparameters"]["memory"]
        assert memory["packing"] and memory["loss"] == "chunked" and memory["estimated_peak_bytes"] > 0
    assert any(m["packed_fraction"] > 0 for m in runs["packed"].logs.values())
    assert all(m["packed_fraction"] == 0 for m in runs["padded"].logs.values())
    assert runs["packed"].logs.keys() == runs["padded"].logs.keys() == {1, 2, 3, 4}
    for step, metrics in runs["padded"].logs.items():
        assert math.isclose(runs["packed"].logs[step]["train_loss"], metrics["train_loss"], rel_tol=1e-4)


@pytest.mark.parametrize("sharding", ["fsdp", "ddp"])
def test_a_run_on_two_devices_is_estimated_at_each_ones_share(tmp_path, decoders, sharding):
    """Each device trains half the rows; under FSDP it also holds half the states and takes the model's own logits
    (the output layer is sharded), as the API's admission counts them (app/services/job_kinds.require_fit)."""
    import dataclasses
    import json

    from worker.engines.device import resolve_device

    config = chat_config(tmp_path, decoders["llama"], _varied_chats(), adapter=None, batch_size=4)
    plan = resolve_device("cpu", "fp32", training=True)
    one = chat.load_policy(config, plan, rows=4, seq_len=64).estimate
    two = chat.load_policy(dataclasses.replace(config, devices=2, sharding=sharding), plan, rows=4, seq_len=64)
    arch = architecture(json.loads((decoders["llama"] / "config.json").read_text()))
    assert arch is not None and one is not None and two.estimate is not None
    expected = training_memory(arch, head="causal-lm", batch_size=2, seq_len=64, precision="fp32",
                               chunked_loss=sharding == "ddp", shards=2 if sharding == "fsdp" else 1)
    assert two.estimate.total_bytes == expected.total_bytes < one.total_bytes
