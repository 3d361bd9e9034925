"""FSDP2 on two gloo processes: each rank holds half of the states, the run follows one process step by step."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as torch_dist
import torch.multiprocessing as mp
from peft import PeftModel
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaForCausalLM

from core.adapters import AdapterConfig
from core.hyperparams import weight_shards
from tests.tiny_chat import CORPUS, build_tiny_llama, tiny_llama_config
from tests.unit.test_engine_training import Recorder
from worker.engines.device import resolve_device
from worker.engines.training.causal_lm import LMTrainConfig, train_lm
from worker.engines.training.distributed import Dist
from worker.engines.training.launch import train_on_devices
from worker.engines.training.loop_helpers import build_adamw
from worker.engines.training.sharded import ShardedReplica, meta_copy, shard_units, tied_aliases

# No dropout: one process and two then compute the same function, so their losses can be compared step by step.
LORA = AdapterConfig(r=4, alpha=8, dropout=0.0, target_modules="all-linear")


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("sharded") / "tiny-llama", seed=2)


def _config(root: Path, base: Path, **overrides) -> LMTrainConfig:
    corpus = root.parent / "corpus.txt"
    corpus.write_text(CORPUS * 2)
    # Steps of two micro-batches of 4 blocks: the ranks keep their unsharded gradients over the first and
    # reduce-scatter once, after the second. lr 2e-2 keeps the gradient clipped (norm > 1) in most steps.
    values = dict(train_file=corpus, eval_file=None, output_dir=root / "out", checkpoint_dir=root / "ckpt",
                  base_model=str(base), block_size=16, batch_size=4, gradient_accumulation_steps=2, max_steps=8,
                  learning_rate=2e-2, warmup_ratio=0.2, seed=5, device="cpu", precision="fp32", eval_steps=4,
                  base_model_name="tiny-llama")
    values.update(overrides)
    return LMTrainConfig(**values)


def test_auto_shards_every_multi_device_run_that_can():
    assert weight_shards("auto", 2) == 2 and weight_shards("fsdp", 4) == 4
    assert weight_shards("ddp", 2) == 1 and weight_shards("auto", 1) == 1
    assert weight_shards("auto", 2, shardable=False) == 1  # reinforcement keeps whole replicas
    with pytest.raises(ValueError, match="cannot shard"):
        weight_shards("fsdp", 2, shardable=False)


def test_units_are_the_layers_and_tied_parameters_stay_with_the_root():
    torch.manual_seed(0)
    llama = LlamaForCausalLM(tiny_llama_config(300))
    assert shard_units(llama) == list(llama.model.layers)[::-1]
    assert tied_aliases(llama) == {}
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=64, n_positions=32))
    assert tied_aliases(gpt2) == {"lm_head.weight": "transformer.wte.weight"}
    assert shard_units(gpt2) == list(gpt2.transformer.h)[::-1]  # wte (tied to the head) stays in the root's group
    copy = meta_copy(gpt2)
    assert all(p.is_meta for p in copy.parameters()) and copy.lm_head.weight is copy.transformer.wte.weight
    assert not any(p.is_meta for p in gpt2.parameters())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _sharded_rank(rank: int, port: int, found: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch_dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = LlamaForCausalLM(tiny_llama_config(300))
        whole = {name: p.numel() for name, p in model.named_parameters()}
        plan = resolve_device("cpu", "fp32", training=True)
        replica = ShardedReplica(Dist(rank=rank, local_rank=rank, world_size=2), model, plan)
        optimizer = build_adamw(model, learning_rate=1e-3, weight_decay=0.0, betas=(0.9, 0.95), plan=plan)
        inputs = torch.randint(0, 300, (2, 8))
        model(input_ids=inputs, labels=inputs).loss.backward()
        optimizer.step()
        local = {name: p.to_local().numel() for name, p in model.named_parameters()}
        grads = {name: p.grad.to_local().numel() for name, p in model.named_parameters()}
        moments = sum(state["exp_avg"].to_local().numel() for state in optimizer.state.values())
        found[rank] = (sum(whole.values()), sum(local.values()), sum(grads.values()), moments,
                       local["model.layers.0.self_attn.q_proj.weight"], whole["model.layers.0.self_attn.q_proj.weight"],
                       replica.plain is not None)
    finally:
        torch_dist.destroy_process_group()


def test_each_rank_holds_half_of_the_weights_gradients_and_adamw_states():
    found = mp.Manager().dict()
    mp.spawn(_sharded_rank, args=(_free_port(), found), nprocs=2, join=True)
    for rank in (0, 1):
        total, weights, grads, moments, q_local, q_whole = found[rank][:6]
        # Each parameter is cut into two row blocks (dim 0): half of it on each rank, an odd row count apart.
        assert q_local == q_whole // 2
        assert abs(weights - total / 2) <= total * 0.01 and grads == weights and moments == weights
    assert found[0][6] and not found[1][6]  # rank 0 alone keeps the plain copy it saves at the end
    assert found[0][1] + found[1][1] == found[0][0]


def _run_and_compare(tmp_path: Path, base: Path, **overrides) -> tuple:
    """One process, then two sharded ones cancelled after step 4 and resumed: the same losses, one history."""
    one = Recorder()
    single = train_lm(_config(tmp_path / "one", base, **overrides), one)
    config = _config(tmp_path / "two", base, devices=2, **overrides)
    assert config.sharding == "auto"
    first = Recorder(stop_at=4)
    stopped = train_on_devices(config, first)
    assert (stopped.status, stopped.global_step) == ("cancelled", 4)
    assert first.info["sharded"] and first.info["world_size"] == 2
    second = Recorder()
    done = train_on_devices(config, second)
    assert done.status == "completed" and second.info["resumed_from_step"] == 4
    history = first.logs + second.logs
    assert [step for step, _, _ in history] == list(range(1, single.total_steps + 1))
    # Same global batch, gradient (the clipped global norm included) and optimizer state across the resume.
    np.testing.assert_allclose([m["train_loss"] for _, _, m in history],
                               [m["train_loss"] for _, _, m in one.logs], rtol=2e-3)
    np.testing.assert_allclose([m["grad_norm"] for _, _, m in history],
                               [m["grad_norm"] for _, _, m in one.logs], rtol=2e-3)
    # Every rank ran the evaluations together; rank 0 reported them.
    assert [step for step, _ in first.evals + second.evals] == [step for step, _ in one.evals]
    np.testing.assert_allclose(done.metrics["eval_loss"], single.metrics["eval_loss"], rtol=2e-3)
    assert done.manifest["hyperparameters"]["sharding"] == "fsdp"
    return single, done


@pytest.mark.slow
def test_a_sharded_full_fine_tune_trains_like_one_process_and_resumes(tmp_path, base):
    single, done = _run_and_compare(tmp_path, base)
    saved = AutoModelForCausalLM.from_pretrained(done.model_dir)  # a plain save_pretrained folder, whole weights
    reference = AutoModelForCausalLM.from_pretrained(single.model_dir)
    for (name, tensor), (_, expected) in zip(saved.state_dict().items(), reference.state_dict().items(), strict=True):
        torch.testing.assert_close(tensor, expected, rtol=2e-2, atol=2e-3, msg=name)


@pytest.mark.slow
def test_a_sharded_lora_run_trains_like_one_process_and_saves_the_adapter(tmp_path, base):
    single, done = _run_and_compare(tmp_path, base, adapter=LORA, metric_for_best="eval_loss")
    assert (done.model_dir / "adapter_model.safetensors").is_file()
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), done.model_dir)
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), single.model_dir)
    inputs = torch.arange(16).unsqueeze(0)
    torch.testing.assert_close(adapted(input_ids=inputs).logits, reference(input_ids=inputs).logits,
                               rtol=2e-2, atol=2e-3)
    assert done.manifest["adapter"]["trainable_parameters"] == single.manifest["adapter"]["trainable_parameters"]
