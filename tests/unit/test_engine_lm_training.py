"""The causal-LM engine end to end on a tiny fresh GPT-2: learning, artifacts, base models, cancel, resume."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    GPT2TokenizerFast,
    PreTrainedTokenizerFast,
)

from core.lm_config import DEFAULT_MODEL_CONFIG, resolve_block_size, validate_model_config
from core.paths import GPT2_TOKENIZER_DIR
from worker.engines.training import causal_lm as lm_training
from worker.engines.training import corpus_data as lm_data
from worker.engines.training.causal_lm import LMTrainConfig, train_lm
from worker.engines.training.loop import DoesNotFit, TrainCallbacks

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "examples" / "data" / "tinyshakespeare_sample.txt"
SHARED = Path("/work/shared/data")
TINY = {"n_layer": 2, "n_embd": 32, "n_head": 2, "n_positions": 64}
VOCAB = 50257
SMALL_BPE_CHARS = 960  # 18 training blocks of 32 tokens (and 2 validation blocks) with the small BPE below


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models on a shared 2-core CPU: two OpenMP threads contending made steps up to 40x slower."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """The GPT-2 BPE saved with its tokenizer.json, so each run loads it in a fraction of a second."""
    assets = GPT2_TOKENIZER_DIR
    if (assets / "vocab.json").is_file():
        tokenizer = GPT2TokenizerFast.from_pretrained(assets)
    else:  # the assets folder is made by a colleague; the shared copy holds the same two files
        source = SHARED / "gpt2-tokenizer"
        tokenizer = GPT2TokenizerFast(vocab=str(source / "vocab.json"), merges=str(source / "merges.txt"))
    path = tmp_path_factory.mktemp("tok") / "gpt2-tokenizer"
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def small_tokenizer_dir(tmp_path_factory, shakespeare) -> Path:
    """A 320-token byte-level BPE: the LM head is 150x smaller than GPT-2's, for tests about the loop only."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([shakespeare], trainer)
    path = tmp_path_factory.mktemp("tok") / "small-bpe"
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>").save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def shakespeare() -> str:
    source = SAMPLE if SAMPLE.is_file() else SHARED / "tinyshakespeare" / "input.txt"
    return source.read_text()[:20_000]


def corpus(tmp_path: Path, text: str, size: int, name: str = "corpus.txt") -> Path:
    """The first `size` characters of text, cut back to a line end."""
    path = tmp_path / name
    path.write_text(text[:text.rindex("\n", 0, size) + 1])
    return path


def make_config(tmp_path: Path, train_file: Path, tokenizer_dir: Path | None, **overrides) -> LMTrainConfig:
    values = dict(train_file=train_file, eval_file=None, output_dir=tmp_path / "out",
                  checkpoint_dir=tmp_path / "ckpt", model_config=TINY, block_size=32, batch_size=4,
                  learning_rate=1e-2, seed=3, device="cpu", base_model_name="tiny-gpt2",
                  tokenizer=str(tokenizer_dir) if tokenizer_dir else None,
                  dataset_hashes={"train": "sha256:abc"},
                  precision="fp32")  # "auto" may pick bf16 on a CPU with native bf16; tested on its own
    values.update(overrides)
    return LMTrainConfig(**values)


class Recorder(TrainCallbacks):
    """Keeps every callback it receives; stops after `stop_at` steps when set."""

    def __init__(self, stop_at: int | None = None) -> None:
        self.stop_at = stop_at
        self.info: dict = {}
        self.logs: list[tuple[int, float, dict]] = []
        self.evals: list[tuple[int, dict]] = []
        self.checkpoints: list[int] = []
        self.events: list[str] = []

    def on_start(self, info):
        self.info = info

    def on_log(self, step, epoch, metrics):
        self.logs.append((step, epoch, metrics))

    def on_eval(self, step, metrics):
        self.evals.append((step, metrics))

    def on_checkpoint(self, step, path):
        self.checkpoints.append(step)

    def on_event(self, kind, message):
        self.events.append(kind)

    def should_stop(self):
        return self.stop_at is not None and len(self.logs) >= self.stop_at


def weights(model_dir: Path) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(str(model_dir / "model.safetensors"))


def test_model_config_validation_names_the_bad_key():
    assert validate_model_config({}) == DEFAULT_MODEL_CONFIG
    assert validate_model_config({"n_layer": 2, "n_embd": 32, "n_head": 2}) == dict(TINY, n_positions=256)
    cases = [({"n_embd": 30, "n_head": 4}, "n_embd.*divisible by n_head"), ({"n_layers": 2}, "'n_layers'"),
             ({"n_head": 0}, "n_head must be between"), ({"n_positions": 64.0}, "n_positions must be an integer"),
             ({"n_layer": True}, "n_layer must be an integer")]
    for bad, message in cases:
        with pytest.raises(ValueError, match=message):
            validate_model_config(bad)
    assert (resolve_block_size(None, 1024), resolve_block_size(None, 64), resolve_block_size(64, 64)) == (256, 64, 64)
    with pytest.raises(ValueError, match="larger than the model's context length"):
        resolve_block_size(65, 64)
    # The API process calls validate_model_config, so its module must stay import-light.
    code = "import sys, core.lm_config; assert not {'torch', 'transformers'} & set(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_blocks_shift_targets_and_epoch_order_is_seeded():
    train, held_out = lm_data.split_blocks(np.arange(101, dtype=np.int32), block_size=10, val_fraction=0.2)
    assert (len(train), len(held_out), train.num_tokens) == (8, 1, 80)  # tokens 0..80 and 81..100
    inputs, targets = train.batch([0, 7])
    assert inputs.dtype == torch.int64 and inputs.shape == targets.shape == (2, 10)
    assert inputs[1].tolist() == list(range(70, 80)) and targets[1].tolist() == list(range(71, 81))
    assert held_out.batch([0])[0][0, 0].item() == 81  # no validation token is ever a training input

    steps = lm_data.epoch_steps(10, batch_size=2, accumulation=2, seed=1, epoch=0)
    assert [[len(micro) for micro in step] for step in steps] == [[2, 2], [2, 2], [2]]
    assert sorted(np.concatenate([m for step in steps for m in step]).tolist()) == list(range(10))
    again = lm_data.epoch_steps(10, 2, 2, seed=1, epoch=0)
    assert all(np.array_equal(a, b) for s, t in zip(steps, again, strict=True) for a, b in zip(s, t, strict=True))
    later = lm_data.epoch_steps(10, 2, 2, seed=1, epoch=1)
    assert not np.array_equal(np.concatenate(sum(steps, [])), np.concatenate(sum(later, [])))
    assert lm_data.eval_indices(5, 8).tolist() == [0, 1, 2, 3, 4]
    assert lm_data.eval_indices(10, 4).tolist() == [0, 2, 5, 7]


def test_rows_become_documents_separated_by_eos(tmp_path, tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"body": "Hello world"}\n{"body": ""}\n{"body": "Good night"}\n')
    documents = lm_data.read_documents(rows, "body")
    assert documents == ["Hello world", "Good night"]  # empty rows add nothing
    tokens = lm_data.tokenize(tokenizer, documents).tolist()
    eos = tokenizer.eos_token_id
    assert tokens == tokenizer("Hello world")["input_ids"] + [eos] + tokenizer("Good night")["input_ids"] + [eos]
    with pytest.raises(ValueError, match="column 'text' not found"):
        lm_data.read_documents(rows, "text")


def test_default_tokenizer_is_the_shipped_gpt2_folder():
    assert lm_training.DEFAULT_TOKENIZER == GPT2_TOKENIZER_DIR


def test_fresh_gpt2_learns_and_saves_a_model_that_generates(tmp_path, tokenizer_dir, shakespeare, monkeypatch):
    monkeypatch.setattr(lm_training, "DEFAULT_TOKENIZER", tokenizer_dir)  # tokenizer=None takes the default
    config = make_config(tmp_path, corpus(tmp_path, shakespeare, 8_000), None, max_steps=16, eval_steps=8)
    recorder = Recorder()
    result = train_lm(config, recorder)

    assert (result.status, result.global_step, result.total_steps) == ("completed", 16, 16)
    assert recorder.info["block_size"] == 32 and recorder.info["context_length"] == 64
    assert [step for step, _, _ in recorder.logs] == list(range(1, 17))
    assert set(recorder.logs[0][2]) >= {"train_loss", "learning_rate", "tokens_per_second"}
    assert [step for step, _ in recorder.evals] == [8, 16]
    # A fresh GPT-2 starts near uniform over the vocabulary, ln(50257) ~ 10.8.
    first, last = recorder.evals[0][1]["eval_loss"], recorder.evals[-1][1]["eval_loss"]
    assert last < first < math.log(VOCAB) and last < math.log(VOCAB) - 1.5
    assert result.metrics["perplexity"] == pytest.approx(math.exp(result.metrics["eval_loss"]))
    assert set(result.metrics) >= {"train_loss", "eval_loss", "perplexity", "train_tokens_per_second",
                                   "train_runtime"}

    manifest = json.loads((config.output_dir / "manifest.json").read_text())
    assert manifest == result.manifest and manifest["task"] == "causal-lm" and "labels" not in manifest
    assert manifest["base_model"] is None and manifest["base_model_name"] == "tiny-gpt2"
    assert manifest["model_config"] == dict(TINY, vocab_size=VOCAB, model_type="gpt2")
    assert manifest["context_length"] == 64 and manifest["data"]["block_size"] == 32
    assert manifest["hyperparameters"]["total_steps"] == 16 and manifest["precision"] == "fp32"
    assert manifest["dataset_hashes"] == {"train": "sha256:abc"} and manifest["tokenizer"] == str(tokenizer_dir)
    assert set(manifest["versions"]) == {"torch", "transformers", "datasets", "python"}

    model = AutoModelForCausalLM.from_pretrained(config.output_dir, use_safetensors=True)
    tokenizer = AutoTokenizer.from_pretrained(config.output_dir)
    prompt = tokenizer("ROMEO:", return_tensors="pt")
    output = model.generate(**prompt, max_new_tokens=5, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    assert output.shape[1] == prompt["input_ids"].shape[1] + 5
    assert tokenizer.decode(output[0]).startswith("ROMEO:")


def test_continues_a_base_model_with_its_own_tokenizer(tmp_path, tokenizer_dir, shakespeare):
    base = tmp_path / "base"
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, **TINY)).save_pretrained(base, safe_serialization=True)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(base)
    rows = tmp_path / "train.jsonl"
    rows.write_text("".join(json.dumps({"text": part}) + "\n" for part in shakespeare[:6_000].split("\n\n")))
    config = make_config(tmp_path, rows, None, base_model=str(base), model_config=None, block_size=None,
                         eval_file=corpus(tmp_path, shakespeare[10_000:], 1_500, "eval.txt"),
                         max_steps=1, learning_rate=1e-9)
    result = train_lm(config)

    assert result.status == "completed"
    assert result.manifest["base_model"] == str(base) and result.manifest["tokenizer"] == str(base)
    assert result.manifest["data"]["block_size"] == 64  # min(n_positions, 256) by default
    assert result.manifest["data"]["held_out"] is False
    before, after = weights(base), weights(config.output_dir)
    # A learning rate of 1e-9 barely moves anything: the run started from the base weights, not a fresh init.
    assert all(torch.allclose(after[name], tensor, atol=1e-6) for name, tensor in before.items())


def test_cancel_checkpoints_and_resume_matches_an_uninterrupted_run(tmp_path, small_tokenizer_dir, shakespeare):
    # 18 train blocks, 4 per step: 5 steps per epoch, the last one short, so the run crosses an epoch
    # boundary and the resume lands on the short step. Dropout stays on: the RNG state must resume too.
    train_file = corpus(tmp_path, shakespeare, SMALL_BPE_CHARS)
    common = dict(batch_size=2, gradient_accumulation_steps=2, max_steps=6, warmup_ratio=0.2)
    whole = train_lm(make_config(tmp_path / "whole", train_file, small_tokenizer_dir, **common))

    parted = make_config(tmp_path / "parted", train_file, small_tokenizer_dir, checkpoint_steps=2, **common)
    first = Recorder(stop_at=4)
    stopped = train_lm(parted, first)
    assert (stopped.status, stopped.global_step, stopped.model_dir) == ("cancelled", 4, None)
    assert first.info["steps_per_epoch"] == 5 and first.checkpoints == [2, 4] and "cancelled" in first.events
    assert not (parted.output_dir / "manifest.json").exists()

    second = Recorder()
    resumed = train_lm(parted, second)
    assert second.info["resumed_from_step"] == 4 and "resumed" in second.events
    assert [step for step, _, _ in second.logs] == [5, 6] and second.checkpoints == [6]
    assert sorted(p.name for p in parted.checkpoint_dir.iterdir()) == ["checkpoint-6"]  # latest; no best tracked
    assert (resumed.status, resumed.global_step) == (whole.status, whole.global_step) == ("completed", 6)
    assert resumed.metrics["train_loss"] == pytest.approx(whole.metrics["train_loss"], rel=1e-6)
    assert resumed.metrics["eval_loss"] == whole.metrics["eval_loss"]
    expected, got = weights(whole.model_dir), weights(resumed.model_dir)
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"model_config": {"n_layer": 2, "n_embd": 30, "n_head": 4}}, "n_embd .* divisible by n_head"),
    ({"model_config": dict(TINY, n_positions=16)}, "larger than the model's context length"),
    ({"model_config": {"depth": 2}}, "unknown key 'depth'"),
    ({"base_model": "some/model"}, "leave it empty when continuing"),
    ({"val_fraction": 0.0}, "val_fraction must be in"),
    ({"block_size": 0}, "block_size must be at least 1"),
])
def test_bad_configs_fail_before_loading_anything(tmp_path, overrides, message):
    config = make_config(tmp_path, tmp_path / "missing.txt", None, **overrides)
    with pytest.raises(ValueError, match=message):
        train_lm(config)


def test_a_corpus_too_short_for_two_blocks_is_refused(tmp_path, tokenizer_dir, shakespeare):
    short = corpus(tmp_path, shakespeare, 300)  # ~80 tokens: a train block of 33 fits, a validation one does not
    with pytest.raises(ValueError, match="validation text has .* too few for one block of 32 \\+ 1"):
        train_lm(make_config(tmp_path, short, tokenizer_dir))
    with pytest.raises(ValueError, match="training text has 0 tokens"):
        train_lm(make_config(tmp_path, corpus(tmp_path, "\n\n\n", 2, "blank.txt"), tokenizer_dir))


def test_a_model_too_big_for_the_device_is_refused_before_it_is_built(tmp_path, small_tokenizer_dir, shakespeare,
                                                                     monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("the model was built")

    monkeypatch.setattr(lm_training, "_build_model", never)
    config = make_config(tmp_path, corpus(tmp_path, shakespeare, SMALL_BPE_CHARS), small_tokenizer_dir,
                         memory_limit_bytes=100 * 1024**2)
    refusal = r"needs about 1\.1 GB .* more than cpu on this worker has \(104\.9 MB\)"
    with pytest.raises(DoesNotFit, match=refusal) as exc:
        train_lm(config)
    assert exc.value.code == "does_not_fit" and not config.checkpoint_dir.exists()
