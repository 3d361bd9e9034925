"""DPO and GRPO on today's architectures: a LoRA of Gemma 3, Qwen3-MoE (experts adapted) and gpt-oss (sink attention,
alternating windows) trains through the one loop with each method, and GRPO's sampled rollouts' log-probabilities
equal HF's forward pass on the same tokens (left-padded batches over sliding windows and routers included)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from core.adapters import AdapterConfig, PreferenceConfig
from core.reinforcement import ReinforcementConfig
from tests.tiny_llama import build_tiny_decoder
from tests.unit.test_engine_chat_training import _config as chat_config
from tests.unit.test_engine_chat_training import _pairs, one_thread  # noqa: F401 - torch on one thread
from tests.unit.test_engine_reinforcement import GRADER, Recorder
from tests.unit.test_engine_reinforcement import _config as rl_config
from worker.engines.training import adapters
from worker.engines.training.chat import train_chat
from worker.engines.training.loop import run
from worker.engines.training.reinforcement import ReinforcementRecipe
from worker.engines.training.rollouts import sample, token_logprobs

ARCHITECTURES = ("gemma3", "qwen3_moe", "gpt_oss")
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
LORA = AdapterConfig(r=4, alpha=8, dropout=0.0, target_modules="all-linear")


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("todays")
    folders = {}
    for name in ARCHITECTURES:
        _, tokenizer = build_tiny_decoder(name, root / name)
        tokenizer.chat_template = CHATML
        tokenizer.save_pretrained(root / name)
        folders[name] = root / name
    return folders


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_dpo_trains_a_lora_of_each(tmp_path, bases, name):
    result = train_chat(chat_config(tmp_path, bases[name], _pairs(), adapter=LORA, max_steps=4,
                                    preference=PreferenceConfig(beta=0.5)))
    assert result.status == "completed" and result.manifest["method"] == "dpo"
    assert math.isfinite(result.metrics["eval_loss"]) and result.metrics["eval_loss"] < math.log(2)


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_grpo_trains_a_lora_of_each(tmp_path, bases, name):
    rl = ReinforcementConfig(grader=GRADER, samples=4, eval_samples=4, max_completion_tokens=4, beta=0.04)
    recorder = Recorder()
    config = rl_config(tmp_path, bases[name], reinforcement=rl, adapter=LORA, max_steps=2, eval_steps=2)
    result = run(config, ReinforcementRecipe(config), recorder)
    assert result.status == "completed" and (tmp_path / "out" / "adapter_model.safetensors").is_file()
    assert all(math.isfinite(m["reward_mean"]) for m in recorder.logs.values())


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_sampled_rollouts_logprobs_equal_hf(bases, name):
    torch.manual_seed(0)
    model = adapters.apply_adapter(AutoModelForCausalLM.from_pretrained(bases[name]), LORA, "causal-lm").eval()
    prompts = [[5, 9, 17, 33, 60, 61, 62], [7, 8], [40, 41, 42, 43]]  # lengths apart: left padding
    with torch.no_grad():
        rollouts = sample(model, prompts, [1, 2, 3], max_new_tokens=5, temperature=1.0, stop_ids=set(), pad_id=0)
        ours = token_logprobs(model, rollouts)
        for row, prompt in enumerate(prompts):
            new = [t for t, live in zip(rollouts.completion_ids[row].tolist(), rollouts.completion_mask[row].tolist(),
                                        strict=True) if live]
            logits = model(torch.tensor([prompt + new])).logits[0].float()
            expected = torch.log_softmax(logits[len(prompt) - 1:-1], -1).gather(1, torch.tensor(new)[:, None])[:, 0]
            torch.testing.assert_close(ours[row, :len(new)].float(), expected, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(rollouts.logprobs[row, :len(new)].float(), expected, rtol=1e-4, atol=1e-4)
