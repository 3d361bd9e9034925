"""What lm-evaluation-harness's `local-completions` model asks of /v1/completions and the tokenizer routes, through
the real gateway, Redis streams and the worker's own code on a tiny GPT-2: echo with logprobs over the prompt (its
first token null), max_tokens 0 or 1, prompts as token ids and lists of prompts, /tokenize and /detokenize."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

PROMPT = "To be, or not to be: that is"
TOLERANCE = 1e-4




def log_softmax(folder, ids: list[int]) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(dim=-1)


def complete(client, **body):
    return client.post("/v1/completions", json={"model": "tiny", "temperature": 0, **body})


def test_echo_scores_the_prompt_as_hf_log_softmax_with_max_tokens_1_and_0(client, served):
    tokenizer = AutoTokenizer.from_pretrained(served)
    ids = tokenizer(PROMPT).input_ids
    response = complete(client, prompt=PROMPT, echo=True, logprobs=1, max_tokens=1)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(ids) + 1  # the prompt's tokens, then the one generated
    expected = log_softmax(served, ids)  # position i: the distribution of token i + 1
    generated = int(expected[-1].argmax())  # greedy
    assert choice["text"].startswith(PROMPT) and choice["finish_reason"] == "length"
    assert logprobs["tokens"] == [tokenizer.decode([t]) for t in [*ids, generated]]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    for position, token in enumerate([*ids[1:], generated]):
        assert logprobs["token_logprobs"][position + 1] == pytest.approx(expected[position, token].item(),
                                                                         abs=TOLERANCE)
        (best, value), = logprobs["top_logprobs"][position + 1].items()
        assert best == tokenizer.decode([int(expected[position].argmax())])
        assert value == pytest.approx(expected[position].max().item(), abs=TOLERANCE)
    offsets = [sum(len(t) for t in logprobs["tokens"][:i]) for i in range(len(logprobs["tokens"]))]
    assert logprobs["text_offset"] == offsets
    assert response.json()["usage"]["prompt_tokens"] == len(ids)

    alone = complete(client, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0)
    assert alone.status_code == 200, alone.text
    body = alone.json()
    choice = body["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == logprobs["tokens"][:-1]
    assert choice["logprobs"]["token_logprobs"] == logprobs["token_logprobs"][:-1]
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] == len(ids)

    plain = complete(client, prompt=PROMPT, echo=True, max_tokens=2)  # echo without logprobs: the text alone
    assert plain.status_code == 200 and plain.json()["choices"][0]["logprobs"] is None
    assert plain.json()["choices"][0]["text"].startswith(PROMPT)


def test_token_id_prompts_and_lists_of_prompts_answer_one_choice_each_in_order(client, served):
    tokenizer = AutoTokenizer.from_pretrained(served)
    first, second = tokenizer("Hello there").input_ids, tokenizer(PROMPT).input_ids
    one = complete(client, prompt=first, echo=True, logprobs=1, max_tokens=0)
    assert one.status_code == 200, one.text
    assert one.json()["choices"][0]["text"] == "Hello there"
    assert len(one.json()["choices"][0]["logprobs"]["tokens"]) == len(first)
    both = complete(client, prompt=[first, second], echo=True, logprobs=1, max_tokens=1, n=2)
    assert both.status_code == 200, both.text
    choices = both.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert [len(c["logprobs"]["tokens"]) for c in choices] == [len(first) + 1] * 2 + [len(second) + 1] * 2
    assert choices[2]["text"].startswith(PROMPT)
    assert both.json()["usage"]["prompt_tokens"] == len(first) + len(second)
    texts = complete(client, prompt=["Hello there", PROMPT], max_tokens=3)
    assert texts.status_code == 200 and [c["index"] for c in texts.json()["choices"]] == [0, 1]


@pytest.mark.parametrize(("override", "field"), [
    ({"max_tokens": 0}, "max_tokens"),  # without echo there is nothing to answer
    ({"echo": True, "stream": True}, "echo"),
    ({"prompt": ["a", "b"], "stream": True}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[1, 2], []]}, "prompt"),
    ({"prompt": [1, 50_257]}, "prompt"),  # past the vocabulary: refused by the worker, naming the field
    ({"prompt": list(range(65))}, "prompt"),  # more ids than the model's context
    ({"prompt": ["x"] * 17}, "prompt"),  # TRAINSERVE_COMPLETIONS_MAX_PROMPTS
    ({"prompt": ["x"] * 5, "n": 16}, "prompt"),  # more rows than the model's queue: never admitted together
    ({"echo": True, "logprobs": 5, "max_tokens": 8, "n": 16, "prompt": "word " * 40}, "logprobs"),
    ({"max_tokens": -1}, "max_tokens"),
])
def test_bad_scoring_requests_are_a_422_naming_the_field(client, served, settings, override, field):
    settings.max_response_entries = 4096
    response = complete(client, **{"prompt": PROMPT, "max_tokens": 2, **override})
    assert response.status_code == 422, response.text
    assert response.json()["error"]["field"].split(".")[0] == field, response.json()


def test_tokenize_and_detokenize_in_vllms_shapes(client, served):
    tokenizer = AutoTokenizer.from_pretrained(served)
    response = client.post("/tokenize", json={"model": "tiny", "prompt": PROMPT})
    assert response.status_code == 200, response.text
    ids = tokenizer(PROMPT).input_ids
    assert response.json() == {"tokens": ids, "count": len(ids), "max_model_len": 64}
    bare = client.post("/tokenize", json={"model": "tiny", "prompt": PROMPT, "add_special_tokens": False})
    assert bare.status_code == 200 and bare.json()["tokens"] == ids  # GPT-2 adds none
    back = client.post("/detokenize", json={"model": "tiny", "tokens": ids})
    assert back.status_code == 200 and back.json() == {"prompt": PROMPT}
    for path, body, status, field in [
        ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model"),
        ("/detokenize", {"model": "nope", "tokens": [1]}, 404, "model"),
        ("/tokenize", {"model": "tiny"}, 422, "prompt"),
        ("/tokenize", {"model": "tiny", "prompt": ""}, 422, "prompt"),
        ("/detokenize", {"model": "tiny", "tokens": [1, 50_257]}, 422, "tokens"),
        ("/detokenize", {"model": "tiny", "tokens": [-1]}, 422, "tokens"),
        ("/detokenize", {"model": "tiny", "tokens": list(range(65))}, 422, "tokens"),
        ("/detokenize", {"model": "tiny", "tokens": []}, 422, "tokens"),
    ]:
        response = client.post(path, json=body)
        assert response.status_code == status, (path, body, response.text)
        assert response.json()["error"]["field"].split(".")[0] == field, (path, body, response.json())
    client.headers.pop("Authorization")
    assert client.post("/tokenize", json={"model": "tiny", "prompt": "x"}).status_code == 401


def test_a_batch_line_refuses_echo_and_token_id_prompts_naming_them():
    """A batch line's answer is built without the prompt: echo, and prompts other than one text, are refused there."""
    import io
    import json

    from app.services.batch_plan import Planning, plan_lines
    from core.served_models import ServedModel
    from core.settings import Settings

    planning = Planning(served=lambda name: ServedModel(id=name, path="/m", owned_by="t", created=0),
                        embedding=str, settings=Settings())
    bodies = [({"prompt": "hi", "echo": True, "max_tokens": 0}, "echo"), ({"prompt": [1, 2]}, "prompt"),
              ({"prompt": ["a", "b"]}, "prompt"), ({"prompt": "hi"}, None)]
    lines = [{"custom_id": str(i), "method": "POST", "url": "/v1/completions", "body": {"model": "tiny", **body}}
             for i, (body, _) in enumerate(bodies)]
    stream = io.BytesIO(b"".join(json.dumps(line).encode() + b"\n" for line in lines))
    planned = list(plan_lines(stream, endpoint="/v1/completions", planning=planning))
    assert [p.error.param if p.error is not None else None for p in planned] == [field for _, field in bodies]
