"""A finished job's full model on this host: the model folder itself, an adapter's merged/ copy when training wrote
one, else the base with the adapter folded in once per host (equal to HF + PEFT on the adapter)."""

from __future__ import annotations

import json
import shutil

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from core.adapters import AdapterConfig
from core.paths import MANIFEST_NAME, job_model_dir
from core.settings import Settings
from core.storage import open_storage
from tests.tiny_adapters import make_adapters, peft_model
from worker.engines.models.manifest import MERGED_DIR
from worker.model_store import fetch_full_model

JOB = "job_0123456789abcdef01234567"


def _store(tmp_path, folder):
    settings = Settings(home=tmp_path / "home")
    target = job_model_dir(settings, JOB)
    shutil.copytree(folder, target)
    (target / MANIFEST_NAME).write_text(json.dumps({"task": "causal-lm", "adapter": {"r": 2}}))
    return open_storage(settings), target


def test_an_adapter_without_a_merged_copy_is_folded_in_once_and_equals_peft(tmp_path, tiny_gpt2_dir):
    folder = make_adapters(tiny_gpt2_dir, tmp_path, {"a": AdapterConfig(r=2, alpha=4, target_modules=["c_attn"])})["a"]
    AutoTokenizer.from_pretrained(tiny_gpt2_dir).save_pretrained(folder)
    storage, _ = _store(tmp_path, folder)
    full = fetch_full_model(storage, JOB)
    assert full.name.endswith(".merged") and (full / MANIFEST_NAME).is_file()
    assert fetch_full_model(storage, JOB) == full  # written once per host
    ids = torch.tensor([[5, 9, 2, 7]])
    with torch.inference_mode():
        merged = AutoModelForCausalLM.from_pretrained(full).eval()(ids).logits
        adapted = peft_model(tiny_gpt2_dir, folder)(ids).logits
    torch.testing.assert_close(merged, adapted, rtol=1e-4, atol=1e-4)
    assert json.loads((full / MANIFEST_NAME).read_text())["merged_from_adapter"] == {"r": 2}


def test_an_adapter_whose_job_wrote_merged_is_served_from_that_copy(tmp_path, tiny_gpt2_dir):
    storage, target = _store(tmp_path, tiny_gpt2_dir)
    (target / "adapter_config.json").write_text("{}")  # an adapter artifact; its merged/ copy is never re-merged
    shutil.copytree(tiny_gpt2_dir, target / MERGED_DIR)
    (target / MERGED_DIR / MANIFEST_NAME).write_text("{}")
    assert fetch_full_model(storage, JOB) == target / MERGED_DIR


def test_a_full_model_is_its_own_folder(tmp_path, tiny_gpt2_dir):
    storage, target = _store(tmp_path, tiny_gpt2_dir)
    assert fetch_full_model(storage, JOB) == target
