"""Chat fine-tuning and DPO on a tiny Llama with LoRA: DPO's loss equals a direct computation with a separate
reference model, and both methods train end to end through the one loop."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from core.adapters import AdapterConfig, PreferenceConfig
from tests.tiny_chat import build_tiny_llama
from worker.engines.training import adapters
from worker.engines.training.chat import ChatTrainConfig, assistant_loss, train_chat
from worker.engines.training.chat_render import IGNORE, collate, render_chat, render_preference
from worker.engines.training.dpo import preference_loss

LORA = AdapterConfig(r=4, alpha=8, dropout=0.0, target_modules="all-linear")
QUESTIONS = ["What is two plus two?", "Name a colour", "How are you today?", "Hi"]
GOOD = ["Four.", "Blue.", "I am fine, thank you.", "Hello there!"]
BAD = ["Seven", "Seven", "Seven", "Seven"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("base") / "tiny-llama", seed=1)


def _pairs() -> list[dict]:
    return [{"input": {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": q}]},
             "preferred_output": [{"role": "assistant", "content": good}],
             "non_preferred_output": [{"role": "assistant", "content": bad}]}
            for q, good, bad in zip(QUESTIONS, GOOD, BAD, strict=True)]


def _chats() -> list[dict]:
    return [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": "Seven", "weight": 0},
                          {"role": "user", "content": q}, {"role": "assistant", "content": good}]}
            for q, good in zip(QUESTIONS, GOOD, strict=True)]


def _jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _direct_logprob(model, rendered) -> torch.Tensor:
    """Sum over labelled positions t of log p(token_t | tokens before t), one unpadded sequence at a time."""
    logits = model(torch.tensor([rendered.input_ids])).logits[0].float()
    total = torch.zeros(())
    for t in range(1, len(rendered.input_ids)):
        if rendered.labels[t] != IGNORE:
            total = total + torch.log_softmax(logits[t - 1], dim=-1)[rendered.input_ids[t]]
    return total


def test_dpo_loss_equals_a_direct_computation_with_a_separate_reference(base):
    tokenizer = AutoTokenizer.from_pretrained(base)
    torch.manual_seed(0)
    model = adapters.apply_adapter(AutoModelForCausalLM.from_pretrained(base), LORA, "causal-lm").eval()
    with torch.no_grad():  # B starts at zero (policy == reference); move it so the log-ratios differ
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    pairs = [render_preference(tokenizer, record) for record in _pairs()]
    chosen, rejected = (collate([pair[side] for pair in pairs], tokenizer.pad_token_id) for side in (0, 1))
    beta = 0.3
    loss, metrics = preference_loss(model, model, None, chosen, rejected, beta)

    reference = AutoModelForCausalLM.from_pretrained(base).eval()  # a second copy: the test's only
    with torch.no_grad():
        margins = torch.stack([
            (_direct_logprob(model, c) - _direct_logprob(reference, c))
            - (_direct_logprob(model, r) - _direct_logprob(reference, r)) for c, r in pairs])
    expected = -F.logsigmoid(beta * margins).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-4, abs=1e-5)
    assert metrics["reward_accuracy"].item() == (margins > 0).float().mean().item()
    assert abs(loss.item() - math.log(2)) > 1e-3  # the adapter made a difference

    loss.backward()
    grads = {name for name, param in model.named_parameters() if param.grad is not None}
    assert grads and all("lora_" in name for name in grads)  # the base gets no gradient


def _config(tmp_path: Path, base: Path, records: list[dict], **overrides) -> ChatTrainConfig:
    data = _jsonl(tmp_path / "train.jsonl", records)
    values = dict(train_file=data, eval_file=data, output_dir=tmp_path / "out", checkpoint_dir=tmp_path / "ckpt",
                  base_model=str(base), adapter=LORA, max_steps=24, batch_size=2, learning_rate=5e-2, seed=2,
                  weight_decay=0.0, device="cpu", precision="fp32", max_length=128)
    values.update(overrides)
    return ChatTrainConfig(**values)


def test_chat_fine_tune_with_lora_learns_the_replies(tmp_path, base):
    config = _config(tmp_path, base, _chats())
    tokenizer = AutoTokenizer.from_pretrained(base)
    examples = [render_chat(tokenizer, chat["messages"], max_length=128) for chat in _chats()]
    batch = collate(examples, tokenizer.pad_token_id)
    with torch.no_grad():
        before = assistant_loss(AutoModelForCausalLM.from_pretrained(base), None, **batch).item()
    result = train_chat(config)
    assert result.status == "completed" and result.manifest["method"] == "sft"
    data = result.manifest["data"]
    assert (data["format"], data["num_train"], data["dropped"]) == ("chat", 4, 0)
    assert result.metrics["eval_loss"] < before / 2
    trained = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(result.model_dir)).eval()
    with torch.no_grad():
        assert assistant_loss(trained, None, **batch).item() == pytest.approx(result.metrics["eval_loss"], rel=1e-4)


def test_dpo_run_prefers_the_preferred_replies(tmp_path, base):
    result = train_chat(_config(tmp_path, base, _pairs(), preference=PreferenceConfig(beta=0.5)))
    assert result.status == "completed" and result.manifest["method"] == "dpo"
    assert result.metrics["eval_loss"] < math.log(2) / 2  # log 2 where it started (adapter B = 0)
    assert result.metrics["eval_reward_accuracy"] == 1.0


def test_wrong_data_and_settings_are_refused(tmp_path, base):
    with pytest.raises(ValueError, match="needs an adapter"):
        train_chat(_config(tmp_path, base, _pairs(), adapter=None, preference=PreferenceConfig()))
    with pytest.raises(ValueError, match="is a preference dataset"):
        train_chat(_config(tmp_path, base, _pairs()))
    with pytest.raises(ValueError, match="no training record keeps a reply"):
        train_chat(_config(tmp_path, base, _chats(), max_length=4))


def _tool_chats() -> list[dict]:
    from tests.tiny_tools import ASKS, tool_conversation

    return [tool_conversation(*ask) for ask in ASKS]


def test_tool_call_data_trains_in_full_and_dpo_pairs_carry_tools(tmp_path):
    """A full fine-tune on tool-call conversations learns the calls (the template writes them, in the loss); a
    DPO run on pairs with tools, a tool call preferred over a refusal, trains too."""
    from tests.tiny_tools import build_tool_base

    base = build_tool_base(tmp_path / "qwen", _tool_chats())
    tokenizer = AutoTokenizer.from_pretrained(base)
    examples = [render_chat(tokenizer, c["messages"], tools=c["tools"], max_length=512) for c in _tool_chats()]
    assert all('"arguments": {' in tokenizer.decode([t for t in e.labels if t != IGNORE]) for e in examples)
    batch = collate(examples, tokenizer.pad_token_id)
    with torch.no_grad():
        before = assistant_loss(AutoModelForCausalLM.from_pretrained(base), None, **batch).item()
    (tmp_path / "sft").mkdir()
    (tmp_path / "dpo").mkdir()
    result = train_chat(_config(tmp_path / "sft", base, _tool_chats() * 2, adapter=None, learning_rate=3e-3,
                                max_steps=16, batch_size=4, max_length=512))
    assert result.status == "completed" and result.metrics["eval_loss"] < before / 2
    pairs = [{"input": {"messages": c["messages"][:1], "tools": c["tools"]},
              "preferred_output": c["messages"][1:], "non_preferred_output": [
                  {"role": "assistant", "content": "I cannot help."}]} for c in _tool_chats()]
    result = train_chat(_config(tmp_path / "dpo", base, pairs, preference=PreferenceConfig(beta=0.5), max_steps=8,
                                max_length=512))
    assert result.status == "completed" and result.metrics["eval_reward_accuracy"] > 0.5
