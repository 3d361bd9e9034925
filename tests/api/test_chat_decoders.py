"""/v1/chat/completions on the llama family: each tiny decoder (Llama-2-style Metaspace and byte-level tokenizers)
with its own chat template, served by one worker, greedy replies equal to HF `apply_chat_template` + `generate`
token for token inside one burst of mixed models, prompts and lengths; logprobs equal HF's log-softmax; structured
output valid from a random Llama.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
import torch

# Llama-2's chat format ([INST] ... [/INST]) and ChatML, as the families ship them.
LLAMA2 = ("{% if messages[0]['role'] == 'system' %}{% set system = '<<SYS>>\\n' + messages[0]['content'] + "
          "'\\n<</SYS>>\\n\\n' %}{% set messages = messages[1:] %}{% else %}{% set system = '' %}{% endif %}"
          "{% for m in messages %}{% if m['role'] == 'user' %}{{ bos_token + '[INST] ' + (system if loop.first "
          "else '') + m['content'] + ' [/INST]' }}{% else %}{{ ' ' + m['content'] + ' ' + eos_token }}{% endif %}"
          "{% endfor %}")
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
TEMPLATES = {"llama": LLAMA2, "mistral": LLAMA2, "qwen2": CHATML, "qwen3": CHATML}
CHATS = [
    [{"role": "user", "content": "Café naïve 🤖 First Citizen:"}],
    [{"role": "system", "content": "Speak as a Roman."}, {"role": "user", "content": "Before we proceed any further"}],
    [{"role": "user", "content": "Hear me speak."}, {"role": "assistant", "content": "Speak, speak."},
     {"role": "user", "content": "You are all resolved rather to die than to famish?"}],
]


@pytest.fixture()
def decoders(settings, worker_ctx):  # noqa: F811
    """Each variant with a chat template under <home>/models/<name>, served by the one in-process worker."""
    from tests.tiny_llama import build_tiny_decoder

    built = {}
    for name, template in TEMPLATES.items():
        model, tokenizer = build_tiny_decoder(name, settings.home / "models" / name)
        tokenizer.chat_template = template
        tokenizer.save_pretrained(settings.home / "models" / name)
        built[name] = (model, tokenizer)
    return built


@pytest.fixture()
def api(client):
    return openai.OpenAI(base_url="http://testserver/v1", api_key=client.headers["Authorization"].split()[1],
                         http_client=client, max_retries=0)


def _reference(model, tokenizer, messages, max_new_tokens):
    """HF's rendering, greedy generate and the log-softmax of each chosen token."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    prompt = torch.tensor([ids])
    with torch.inference_mode():
        out = model.generate(prompt, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0)
        logits = model(out).logits[0].float()
    new = out[0, len(ids):]
    logprobs = logits.log_softmax(-1)[len(ids) - 1:-1].gather(1, new[:, None])[:, 0]
    return len(ids), tokenizer.decode(new, skip_special_tokens=True), logprobs.tolist()


def test_every_family_chats_as_hf_inside_one_mixed_burst(api, decoders):
    jobs = [(name, chat, 6 + 3 * index) for name in TEMPLATES for index, chat in enumerate(CHATS)]

    def ask(job):
        name, chat, tokens = job
        return api.chat.completions.create(model=name, messages=chat, max_tokens=tokens, temperature=0,
                                           logprobs=True, top_logprobs=2)

    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:  # one burst: rows of several models and lengths
        replies = list(pool.map(ask, jobs))
    for (name, chat, tokens), reply in zip(jobs, replies, strict=True):
        model, tokenizer = decoders[name]
        prompt_tokens, text, logprobs = _reference(model, tokenizer, chat, tokens)
        choice = reply.choices[0]
        assert choice.message.content == text, (name, chat)
        assert reply.usage.prompt_tokens == prompt_tokens
        got = [entry.logprob for entry in choice.logprobs.content]
        assert got == pytest.approx(logprobs[:len(got)], abs=1e-3)
        assert all(len(entry.top_logprobs) == 2 for entry in choice.logprobs.content)


def test_metaspace_logprob_bytes_are_each_tokens_own_bytes(api, decoders):
    """A SentencePiece-style token reports its piece with the word marker as a space; a byte-fallback token its byte."""
    model, tokenizer = decoders["llama"]
    reply = api.chat.completions.create(model="llama", messages=CHATS[0], max_tokens=12, temperature=0,
                                        logprobs=True)
    ids = tokenizer.apply_chat_template(CHATS[0], add_generation_prompt=True, tokenize=True, return_dict=False)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=12, pad_token_id=0)
    expected = []
    for piece in tokenizer.convert_ids_to_tokens(out[0, len(ids):].tolist()):
        if piece == tokenizer.eos_token:
            break
        is_byte = len(piece) == 6 and piece.startswith("<0x")
        expected.append(bytes([int(piece[3:5], 16)]) if is_byte else piece.replace("\u2581", " ").encode())
    assert [bytes(entry.bytes) for entry in reply.choices[0].logprobs.content] == expected


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"enum": ["Caius", "Menenius"]}, "age": {"type": "integer", "minimum": 1,
                                                                          "maximum": 99},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}}}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_structured_output_from_a_random_llama_always_validates(api, decoders, temperature):
    response_format = {"type": "json_schema", "json_schema": {"name": "citizen", "schema": SCHEMA}}
    reply = api.chat.completions.create(model="llama", messages=CHATS[1], max_tokens=60, temperature=temperature,
                                        response_format=response_format, n=3, seed=2)
    for choice in reply.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
