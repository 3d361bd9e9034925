"""Reinforcement fine-tuning of a causal LM on prompts scored by a grader: GRPO as a task of the loop.

Per micro-batch of prompts: sample `samples` completions of each with the policy as it is now (rollouts.py, the
training model with its KV cache, in eval mode), score each with the job's grader (core.graders: the reward),
turn rewards into group-relative advantages and take GRPO's loss (grpo.py) over the completion tokens, their
log-probabilities recomputed by the training forward; the KL reference is the same model with its adapter off
(no second copy of the base). A step's rewards (mean and spread, per grader), KL, clip fraction and completion
length reach the loop's on_log through `step_metrics`. Evaluation samples `eval_samples` completions of each
validation prompt with fixed seeds (the same draws at every evaluation) and reports their mean reward; the model
as it starts is evaluated too (`eval_reward_at_start` in the start report), so the curve has its origin.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from core.chat_data import MAX_LENGTH, read_records
from core.errors import DomainError
from core.graders import grade, sample_namespace
from core.graders.spec import PythonGrader
from core.reinforcement import ReinforcementConfig, graders_of, metric_name
from worker.engines.device import DevicePlan
from worker.engines.models import manifest as manifests
from worker.engines.models.tokenizers import load_tokenizer_files
from worker.engines.training import adapters, artifacts
from worker.engines.training import tabular_data as data
from worker.engines.training.chat import ChatTrainConfig, load_policy
from worker.engines.training.grpo import group_advantages, grpo_loss
from worker.engines.training.loop import Setup
from worker.engines.training.rollouts import Rollouts, rollout_seed, sample, token_logprobs

if TYPE_CHECKING:
    from worker.engines.training.loop_types import TrainedModel

EVAL_STREAM = 2**31  # the eval draws' seed coordinate: apart from every (epoch, slot) of training


@dataclass(frozen=True, kw_only=True)
class ReinforcementTrainConfig(ChatTrainConfig):
    """One GRPO run of base_model on a prompts dataset (core.chat_data), rewarded by `reinforcement.grader`."""

    reinforcement: ReinforcementConfig


@dataclass(frozen=True)
class Prompt:
    """A rendered prompt and its record (the grader's `item`)."""

    input_ids: list[int]
    item: dict[str, Any]


class ReinforcementRecipe:
    """Prompts, rollouts from the policy, grader rewards, GRPO's loss."""

    unit = "samples"
    adam_betas = (0.9, 0.999)
    # Each rank samples answers of its own lengths, so ranks run different numbers of forwards in a step; a sharded
    # model's every forward gathers from all ranks at once: several devices keep whole replicas (core.hyperparams).
    shardable = False

    def __init__(self, config: ReinforcementTrainConfig) -> None:
        rl = config.reinforcement
        if rl.beta > 0 and config.adapter is None:
            raise ValueError("a KL penalty (beta > 0) needs an adapter: the reference is the base with it off")
        self.config, self.rl = config, rl
        self.max_length = MAX_LENGTH if config.max_length is None else config.max_length  # tokens of a rendered prompt
        self.names = [name for name, _ in graders_of(rl.grader)]
        self._step: dict[str, list[float]] = {}

    def build(self, plan: DevicePlan) -> Setup:
        """Render the prompts with the base model's template, then load (and adapt) the model if it fits."""
        config, rl = self.config, self.rl
        self.plan = plan
        self.tokenizer = load_tokenizer_files(config.base_model)
        self.pad_id = next(i for i in (self.tokenizer.pad_token_id, self.tokenizer.eos_token_id, 0) if i is not None)
        self.train_set, self.dropped = self._prompts(config.train_file)
        if not self.train_set:
            raise ValueError(f"no training prompt fits in max_length={self.max_length} tokens")
        self.eval_set = self._prompts(config.eval_file)[0] if config.eval_file is not None else []
        self.lengths = np.array([len(prompt.input_ids) for prompt in self.train_set])
        # Each prompt trains `samples` rows of prompt and completion; only the completions' tokens carry a target.
        rows = config.batch_size * rl.samples
        self.policy = load_policy(config, plan, rows=rows, seq_len=int(self.lengths.max()) + rl.max_completion_tokens,
                                  loss_tokens=rows * rl.max_completion_tokens, shardable=self.shardable)
        self.model: TrainedModel = self.policy.model
        self.stop_ids = stop_ids(self.tokenizer, self.model)
        settings = {"adapter": config.adapter.model_dump() if config.adapter else None,
                    "reinforcement": rl.model_dump(mode="json")}
        start = self._evaluate_at_start()
        return Setup(
            model=self.model, num_examples=len(self.train_set), units_per_example=1,
            identity={"num_train": len(self.train_set), "max_length": self.max_length, "seed": config.seed,
                      "batch_size": config.batch_size, "rollout_seeds": "seed/epoch/slot/sample",
                      "gradient_accumulation_steps": config.gradient_accumulation_steps, **settings},
            info={"num_train": len(self.train_set), "num_eval": len(self.eval_set), "dropped": self.dropped,
                  "format": "prompts", "samples_per_prompt": rl.samples, **start},
            hyperparameters={"max_length": self.max_length, **settings, "memory": self.policy.describe()},
        )

    def _evaluate_at_start(self) -> dict[str, float]:
        """The validation reward of the model before any step (a new adapter changes nothing yet): the curve's
        start, reported with the run's start."""
        if not self.eval_set:
            return {}
        self.model.eval()
        try:
            with torch.inference_mode(), self.plan.autocast():
                metrics = self.evaluate() or {}
        finally:
            self.model.train()
        return {f"{name}_at_start": value for name, value in metrics.items()}

    def _prompts(self, path: Any) -> tuple[list[Prompt], int]:
        """Each record's messages rendered with the generation prompt; the count of those past max_length."""
        try:
            fmt, records = read_records(path)
        except DomainError as exc:  # the engine's contract is ValueError for bad input
            raise ValueError(f"{path.name}: {exc.message}") from exc
        if fmt != "prompts":
            raise ValueError(f"{path.name} is a {fmt} dataset; reinforcement fine-tuning needs a prompts dataset")
        kept: list[Prompt] = []
        for line_no, record in records:
            messages = [{"role": m["role"], "content": m["content"]} for m in record["messages"]]
            try:
                ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                         return_dict=False)
            except Exception as exc:  # noqa: BLE001 - a template's own error (raise_exception) names no line
                raise ValueError(f"{path.name} line {line_no}: the chat template cannot render it: {exc}") from exc
            if len(ids) <= self.max_length:
                kept.append(Prompt([int(i) for i in cast(list[int], ids)], record))
        return kept, len(records) - len(kept)

    def epoch_steps(self, epoch: int) -> list[list[list[tuple[int, int, int]]]]:
        """Seeded steps of prompts, each prompt with its rollouts' seed coordinates (epoch, slot in the epoch)."""
        config = self.config
        steps = data.epoch_steps(self.lengths, config.batch_size, config.gradient_accumulation_steps, config.seed,
                                 epoch)
        per_step = config.batch_size * config.gradient_accumulation_steps
        return [[[(index, epoch, number * per_step + m * config.batch_size + k) for k, index in enumerate(micro)]
                 for m, micro in enumerate(step)] for number, step in enumerate(steps)]

    def rollouts(self, prompts: list[Prompt], seeds: list[list[int]]) -> tuple[Rollouts, list[str]]:
        """Sample one completion per seed of each prompt (a prompt's rows contiguous) and decode them."""
        model, rl = self.model, self.rl
        was_training = model.training
        model.eval()  # no adapter dropout while sampling
        try:
            rows = [prompt.input_ids for prompt, group in zip(prompts, seeds, strict=True) for _ in group]
            out = sample(model, rows, [seed for group in seeds for seed in group],
                         max_new_tokens=rl.max_completion_tokens, temperature=rl.temperature,
                         stop_ids=self.stop_ids, pad_id=self.pad_id)
        finally:
            model.train(was_training)
        texts = []
        for ids, mask in zip(out.completion_ids.tolist(), out.completion_mask.tolist(), strict=True):
            kept = [token for token, live in zip(ids, mask, strict=True) if live and token not in self.stop_ids]
            texts.append(str(self.tokenizer.decode(kept, skip_special_tokens=True)))
        return out, texts

    def rewards(self, items: list[dict[str, Any]], texts: list[str]) -> dict[str, list[float]]:
        """Each sample's reward (key "reward") and, for a multi grader, each named part's score."""
        grader = self.rl.grader
        assert not isinstance(grader, PythonGrader)  # refused when the spec was validated

        async def run() -> list[Any]:
            return await asyncio.gather(*(grade(grader, item=item, sample=sample_namespace(text), models=None)
                                          for item, text in zip(items, texts, strict=True)))

        grades = asyncio.run(run())
        scores = {"reward": [g.score for g in grades]}
        if len(self.names) > 1 or self.names[0] != grader.name:
            for name in self.names:
                scores[name] = [g.sub_scores.get(name, 0.0) for g in grades]
        return scores

    def loss(self, model: torch.nn.Module, micro_batch: list[tuple[int, int, int]]) -> torch.Tensor:
        """GRPO's loss over fresh rollouts of the micro-batch's prompts (see the module's docstring)."""
        rl, seed = self.rl, self.config.seed
        prompts = [self.train_set[index] for index, _, _ in micro_batch]
        seeds = [[rollout_seed(seed, epoch, slot, j) for j in range(rl.samples)] for _, epoch, slot in micro_batch]
        rollouts, texts = self.rollouts(prompts, seeds)
        items = [prompt.item for prompt in prompts for _ in range(rl.samples)]
        scores = self.rewards(items, texts)
        device = self.plan.device
        rewards = torch.tensor(scores["reward"], dtype=torch.float32, device=device)
        advantages = group_advantages(rewards, rl.samples, scale=rl.scale_rewards)
        checks = self.policy.checks
        logps = token_logprobs(model, rollouts, rl.temperature, checks)
        ref = None
        if rl.beta > 0:
            adapted: Any = self.model  # a PeftModel: the reference is it with the adapter off
            with torch.no_grad(), adapted.disable_adapter():
                ref = token_logprobs(model, rollouts, rl.temperature, checks)
        parts = grpo_loss(logps, logps.detach(), ref, advantages, rollouts.completion_mask, beta=rl.beta,
                          epsilon=rl.epsilon, epsilon_high=rl.epsilon_high or rl.epsilon, loss_type=rl.loss_type,
                          max_completion_tokens=rl.max_completion_tokens)
        self._record(scores, rollouts, parts.kl, parts.clip_fraction, rewards.view(-1, rl.samples))
        return parts.loss

    def _record(self, scores: dict[str, list[float]], rollouts: Rollouts, kl: float, clip_fraction: float,
                grouped: torch.Tensor) -> None:
        step = self._step
        for name, values in scores.items():
            step.setdefault(name, []).extend(values)
        rows = len(scores["reward"])
        step.setdefault("completion_length", []).extend(rollouts.completion_mask.sum(dim=1).float().tolist())
        step.setdefault("kl", []).extend([kl] * rows)
        step.setdefault("clip_fraction", []).extend([clip_fraction] * rows)
        step.setdefault("frac_reward_zero_std", []).extend([float(g.std() < 1e-6) for g in grouped] * self.rl.samples)

    def step_metrics(self) -> dict[str, float]:
        """What the step's micro-batches sampled and scored (the loop adds them to on_log), then reset."""
        step, self._step = self._step, {}
        if not step:
            return {}
        metrics: dict[str, float] = {}
        for name in ["reward", *(n for n in self.names if n in step)]:
            values = np.array(step[name])
            metrics[metric_name("reward", name, "mean") if name != "reward" else "reward_mean"] = float(values.mean())
            metrics[metric_name("reward", name, "std") if name != "reward" else "reward_std"] = float(values.std())
        for name in ("kl", "clip_fraction", "completion_length", "frac_reward_zero_std"):
            metrics[name] = float(np.mean(step[name]))
        return metrics

    def evaluate(self) -> dict[str, float] | None:
        """Mean reward of `eval_samples` completions per validation prompt, drawn with the same seeds each time."""
        if not self.eval_set:
            return None
        rl, seed = self.rl, self.config.seed
        totals: dict[str, list[float]] = {}
        size = max(1, self.config.batch_size)
        for start in range(0, len(self.eval_set), size):
            prompts = self.eval_set[start:start + size]
            seeds = [[rollout_seed(seed, EVAL_STREAM, start + i, j) for j in range(rl.eval_samples)]
                     for i in range(len(prompts))]
            _, texts = self.rollouts(prompts, seeds)
            items = [prompt.item for prompt in prompts for _ in range(rl.eval_samples)]
            for name, values in self.rewards(items, texts).items():
                totals.setdefault(name, []).extend(values)
        metrics = {"eval_reward": float(np.mean(totals.pop("reward")))}
        for name, values in totals.items():
            metrics[metric_name("eval_reward", name)] = float(np.mean(values))
        return metrics

    def save(self, metrics: dict[str, float], hyperparameters: dict[str, Any], plan: DevicePlan) -> dict[str, Any]:
        """The adapter folder (or the full model) with the tokenizer and a manifest naming the method and grader."""
        config = self.config
        manifest = manifests.build_manifest(
            task="causal-lm", base_model=config.base_model, base_model_name=config.base_model_name or config.base_model,
            hyperparameters=hyperparameters, dataset_hashes=dict(config.dataset_hashes), metrics=metrics, plan=plan,
            data={"format": "prompts", "num_train": len(self.train_set), "dropped": self.dropped,
                  "num_eval": len(self.eval_set), "max_length": self.max_length})
        manifest["method"] = "reinforcement"
        if config.adapter is not None:
            manifest["adapter"] = adapters.adapter_summary(self.model, config.adapter)
        artifacts.save_final(config.output_dir, self.model, self.tokenizer, manifest,
                             merged=bool(config.adapter and config.adapter.merge))
        return manifest


def stop_ids(tokenizer: Any, model: torch.nn.Module) -> set[int]:
    """The tokens that end an answer: the tokenizer's eos and the model's generation config's (a chat model's
    end-of-turn token is often only there, e.g. Llama 3's <|eot_id|> beside <|end_of_text|>)."""
    generation = getattr(model, "generation_config", None)
    configured = getattr(generation, "eos_token_id", None)
    ids = set(configured) if isinstance(configured, (list, tuple)) else {configured}
    return {int(i) for i in ids | {tokenizer.eos_token_id} if i is not None}
