"""Today's architectures end to end on real workers: a chat SFT job of Gemma 3, Phi-3, OLMo 2, Qwen3-MoE and gpt-oss,
full and LoRA, trained through /jobs and served through the `openai` client's chat route, every greedy reply equal to
HF `generate` on the downloaded model (HF + PEFT on the downloaded adapter, which the worker serves merged)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from transformers import AutoTokenizer

from tests.factories import upload
from tests.integration.test_lora_jobs import CHATS, _download, _finished, _submit
from tests.tiny_adapters import hf_greedy, peft_model
from tests.tiny_chat import chat_jsonl
from tests.tiny_llama import build_tiny_decoder

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(480)]

ARCHITECTURES = ("gemma3", "phi3", "olmo2", "qwen3_moe", "gpt_oss")
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
HP = {"max_steps": 3, "batch_size": 2, "learning_rate": 5e-2, "precision": "fp32", "block_size": 64}
LORA = {"r": 4, "alpha": 16, "dropout": 0.05, "target_modules": "all-linear"}


def test_each_architecture_trains_full_and_lora_and_serves_equal_to_hf(live_client, start_worker, settings,
                                                                      tmp_path):
    for name in ARCHITECTURES:
        _, tokenizer = build_tiny_decoder(name, settings.home / "models" / name)
        tokenizer.chat_template = CHATML
        tokenizer.save_pretrained(settings.home / "models" / name)
    settings.generation_wait_s = 120
    start_worker("training")
    start_worker("generation", TRAINSERVE_GENERATION_PRECISION="fp32")  # fp32: HF-exact
    data = upload(live_client, chat_jsonl("Blue."), filename="chat.jsonl").json()["id"]
    jobs = {(name, kind): _submit(live_client, {
        "task": "causal-lm", "base_model": name, "train_dataset": data, "hyperparameters": HP,
        **({"adapter": LORA} if kind == "lora" else {})}) for name in ARCHITECTURES for kind in ("full", "lora")}
    api = openai.OpenAI(base_url="http://testserver/v1", api_key=live_client.headers["Authorization"].split()[1],
                        http_client=live_client, max_retries=0)
    for (name, kind), job_id in jobs.items():
        job = _finished(live_client, job_id)
        folder = _download(live_client, job, tmp_path / job_id)
        base = settings.home / "models" / name
        reference = peft_model(base, folder) if kind == "lora" else peft_model(folder, None)
        tokenizer = AutoTokenizer.from_pretrained(base)

        def ask(index: int, job_id: str = job_id) -> str:
            reply = api.chat.completions.create(model=job_id, messages=CHATS[index], max_tokens=8, temperature=0)
            return reply.choices[0].message.content or ""

        with ThreadPoolExecutor(len(CHATS)) as pool:  # one burst: the rows share the engine's batches
            replies = list(pool.map(ask, range(len(CHATS))))
        for index, text in enumerate(replies):
            ids = tokenizer.apply_chat_template(CHATS[index], add_generation_prompt=True, tokenize=True,
                                                return_dict=False)
            expected = hf_greedy(reference, list(ids), 8)
            assert text == tokenizer.decode(expected, skip_special_tokens=True), (name, kind, index)
