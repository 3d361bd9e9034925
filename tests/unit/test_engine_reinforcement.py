"""Reinforcement fine-tuning (GRPO) on a tiny Llama with LoRA: rollout log-probabilities equal HF's, the loss is
TRL's, a verifiable reward rises within a short run, and a resumed run equals an uninterrupted one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from core.adapters import AdapterConfig
from core.reinforcement import ReinforcementConfig
from tests.tiny_chat import build_tiny_llama
from tests.unit.test_engine_chat_training import one_thread  # noqa: F401 - torch on one thread
from worker.engines.training import adapters
from worker.engines.training.grpo import group_advantages, grpo_loss
from worker.engines.training.loop import TrainCallbacks, run
from worker.engines.training.reinforcement import ReinforcementRecipe, ReinforcementTrainConfig
from worker.engines.training.rollouts import rollout_seed, sample, token_logprobs

LORA = AdapterConfig(r=8, alpha=16, dropout=0.0, target_modules="all-linear")
QUESTIONS = ["What is two plus two?", "Name a colour.", "How are you today?", "Be brief.", "Hello there!",
             "What colour is the sky?"]
# Verifiable: the answer contains the digit the record names (string_check `like` on item.answer).
GRADER = {"type": "string_check", "name": "has answer", "input": "{{sample.output_text}}",
          "reference": "{{item.answer}}", "operation": "like"}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("rft-base") / "tiny-llama", seed=1)


def _prompts(path: Path, questions: list[str]) -> Path:
    records = [{"messages": [{"role": "user", "content": q}], "answer": "1"} for q in questions]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


class Recorder(TrainCallbacks):
    def __init__(self, stop_at: int | None = None) -> None:
        self.info: dict = {}
        self.logs: dict[int, dict[str, float]] = {}
        self.evals: dict[int, dict[str, float]] = {}
        self.stop_at = stop_at

    def on_start(self, info):
        self.info = info

    def on_log(self, step, epoch, metrics):
        self.logs[step] = metrics

    def on_eval(self, step, metrics):
        self.evals[step] = metrics

    def should_stop(self):
        return self.stop_at is not None and max(self.logs, default=0) >= self.stop_at


def _config(tmp_path: Path, base: Path, **overrides) -> ReinforcementTrainConfig:
    rl = overrides.pop("reinforcement", ReinforcementConfig(grader=GRADER, samples=8, eval_samples=8,
                                                            max_completion_tokens=4, beta=0.04))
    values = dict(train_file=_prompts(tmp_path / "train.jsonl", QUESTIONS),
                  eval_file=_prompts(tmp_path / "eval.jsonl", QUESTIONS[:4]), output_dir=tmp_path / "out",
                  checkpoint_dir=tmp_path / "checkpoints", base_model=str(base), adapter=LORA, reinforcement=rl,
                  batch_size=3, learning_rate=2e-2, weight_decay=0.0, max_steps=12, eval_steps=4, seed=0,
                  device="cpu", precision="fp32")
    values.update(overrides)
    return ReinforcementTrainConfig(**values)


def test_sampled_token_logprobs_equal_hf_in_fp32(base):
    torch.manual_seed(0)
    model = adapters.apply_adapter(AutoModelForCausalLM.from_pretrained(base), LORA, "causal-lm")
    for name, param in model.named_parameters():
        if "lora_B" in name:  # a trained-looking adapter, so the policy is not the base
            param.data.normal_(0, 0.2)
    model.eval()
    prompts = [[0, 2, 30, 40, 50, 3], [0, 2, 60, 3], [0, 2, 70, 80, 3]]
    rollouts = sample(model, prompts, [rollout_seed(7, i) for i in range(3)], max_new_tokens=6, temperature=1.0,
                      stop_ids={4}, pad_id=1)
    with torch.no_grad():
        recomputed = token_logprobs(model, rollouts)
    for row, prompt in enumerate(prompts):
        live = rollouts.completion_mask[row].bool()
        completion = rollouts.completion_ids[row][live].tolist()
        ids = torch.tensor([prompt + completion])
        with torch.no_grad():
            logits = model(input_ids=ids).logits  # HF: one unpadded row, no cache
        hf = torch.log_softmax(logits.float(), dim=-1)[0, len(prompt) - 1:-1].gather(
            1, torch.tensor(completion).unsqueeze(1)).squeeze(1)
        torch.testing.assert_close(recomputed[row][live], hf, atol=1e-4, rtol=0)
        torch.testing.assert_close(rollouts.logprobs[row][live], hf, atol=1e-4, rtol=0)


def test_rollouts_depend_on_their_seed_not_on_the_batch(base):
    model = AutoModelForCausalLM.from_pretrained(base).eval()
    prompt = [0, 2, 30, 40, 3]
    alone = sample(model, [prompt], [11], max_new_tokens=5, temperature=1.0, stop_ids={4}, pad_id=1)
    shared = sample(model, [[0, 2, 9, 3], prompt, prompt], [5, 11, 12], max_new_tokens=5, temperature=1.0,
                    stop_ids={4}, pad_id=1)
    width = alone.completion_ids.shape[1]
    assert shared.completion_ids[1, :width].tolist() == alone.completion_ids[0].tolist()


def test_advantages_and_loss_are_trls():
    rewards = torch.tensor([1.0, 0.0, 0.0, 2.0, 2.0, 2.0])
    adv = group_advantages(rewards, 3, scale=True)
    first = torch.tensor([1.0, 0.0, 0.0])
    torch.testing.assert_close(adv[:3], (first - first.mean()) / (first.std() + 1e-4))
    assert adv[3:].abs().max() < 1e-6  # one group's equal rewards: no advantage
    logps = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], requires_grad=True)
    old = torch.tensor([[-1.5, -2.0], [-0.5, -2.0]])
    ref = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    advantages = torch.tensor([1.0, -1.0])
    parts = grpo_loss(logps, old, ref, advantages, mask, beta=0.1, epsilon=0.2, epsilon_high=0.2, loss_type="grpo",
                      max_completion_tokens=2)
    ratio = torch.exp(logps - old)
    per_token = -torch.min(ratio * advantages[:, None], ratio.clamp(0.8, 1.2) * advantages[:, None])
    kl = torch.exp(ref - logps) - (ref - logps) - 1
    per_token = per_token + 0.1 * kl
    expected = ((per_token[0, 0] + per_token[0, 1]) / 2 + per_token[1, 0]) / 2
    torch.testing.assert_close(parts.loss, expected)
    # Row 0 token 0: ratio e^0.5 > 1.2 with a positive advantage: clipped; 1 token of 3.
    assert parts.clip_fraction == pytest.approx(1 / 3)
    dapo = grpo_loss(logps, old, ref, advantages, mask, beta=0.1, epsilon=0.2, epsilon_high=0.2, loss_type="dapo",
                     max_completion_tokens=2)
    dr = grpo_loss(logps, old, ref, advantages, mask, beta=0.1, epsilon=0.2, epsilon_high=0.2, loss_type="dr_grpo",
                   max_completion_tokens=2)
    torch.testing.assert_close(dapo.loss, (per_token * mask).sum() / 3)
    torch.testing.assert_close(dr.loss, (per_token * mask).sum() / 4)


def test_rft_raises_the_validation_reward(tmp_path, base):
    recorder = Recorder()
    result = run((config := _config(tmp_path, base, max_steps=16)), ReinforcementRecipe(config), recorder)
    curve = {0: round(recorder.info["eval_reward_at_start"], 3),
             **{step: round(m["eval_reward"], 3) for step, m in sorted(recorder.evals.items())}}
    print("validation reward by step:", curve)
    print("train reward by step:", {step: round(m["reward_mean"], 3) for step, m in sorted(recorder.logs.items())})
    assert result.status == "completed" and (tmp_path / "out" / "adapter_model.safetensors").is_file()
    assert curve[0] < 0.3 and curve[16] >= 0.75 and curve[16] - curve[0] >= 0.5, curve
    step = recorder.logs[1]
    for name in ("reward_mean", "reward_std", "kl", "clip_fraction", "completion_length", "frac_reward_zero_std"):
        assert name in step
    assert recorder.logs[16]["kl"] > 0  # the policy moved away from the base with the adapter off


class CrashingRecipe(ReinforcementRecipe):
    """Dies inside the loss of its `crash_at`-th micro-batch, as a killed process would mid-step."""

    crash_at = 5

    def loss(self, model, micro_batch):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == self.crash_at:
            raise KeyboardInterrupt("killed mid-step")
        return super().loss(model, micro_batch)


@pytest.mark.parametrize("stop", ["cancel", "kill"])
def test_a_resumed_run_equals_an_uninterrupted_one(tmp_path, base, stop):
    whole = Recorder()
    (tmp_path / "whole").mkdir()
    (tmp_path / "parts").mkdir()
    config = _config(tmp_path / "whole", base, max_steps=6, eval_steps=None, eval_file=None)
    run(config, ReinforcementRecipe(config), whole)
    split = _config(tmp_path / "parts", base, max_steps=6, eval_steps=None, eval_file=None, checkpoint_steps=3)
    first = Recorder(stop_at=3 if stop == "cancel" else None)
    if stop == "cancel":
        assert run(split, ReinforcementRecipe(split), first).status == "cancelled"
    else:  # step 5 dies half done: the resume starts again from step 3's checkpoint
        with pytest.raises(KeyboardInterrupt):
            run(split, CrashingRecipe(split), first)
        assert max(first.logs) == 4
    second = Recorder()
    assert run(split, ReinforcementRecipe(split), second).status == "completed"
    assert min(second.logs) == 4
    resumed = {**first.logs, **second.logs}
    for step in range(1, 7):
        for name in ("reward_mean", "kl", "completion_length", "train_loss"):
            assert resumed[step][name] == pytest.approx(whole.logs[step][name], abs=1e-6), (step, name)
    a = load_file(tmp_path / "whole" / "out" / "adapter_model.safetensors")
    b = load_file(tmp_path / "parts" / "out" / "adapter_model.safetensors")
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-6, rtol=0)


def test_a_multi_graders_parts_are_reported_apart(tmp_path, base):
    grader = {"type": "multi", "name": "combined", "calculate_output": "0.5 * digit + 0.5 * short",
              "graders": {"digit": GRADER, "short": {"type": "text_similarity", "name": "short",
                                                     "input": "{{sample.output_text}}", "reference": "1",
                                                     "evaluation_metric": "fuzzy_match"}}}
    rl = ReinforcementConfig(grader=grader, samples=4, eval_samples=2, max_completion_tokens=3, beta=0.0,
                             loss_type="dapo", epsilon_high=0.28)
    recorder = Recorder()
    run((config := _config(tmp_path, base, reinforcement=rl, max_steps=2, eval_steps=None)),
        ReinforcementRecipe(config), recorder)
    step = recorder.logs[1]
    for name in ("reward_digit_mean", "reward_digit_std", "reward_short_mean", "reward_short_std"):
        assert name in step
    assert step["reward_mean"] == pytest.approx(0.5 * step["reward_digit_mean"] + 0.5 * step["reward_short_mean"])
    assert step["kl"] == 0.0  # beta 0: no reference forward
    assert set(recorder.evals[2]) == {"eval_reward", "eval_reward_digit", "eval_reward_short"}
    assert set(recorder.info) >= {"eval_reward_at_start", "eval_reward_digit_at_start"}
