"""Issue 7's must-show checks against a real uvicorn server running the real SmolLM2-135M model.

The constrained-decoding checks (JSON schema, regex, choices, bad constraints) fail, never skip,
when the server does not enforce a constraint: a broken constraint path must show as a failure.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import jsonschema
import pytest
from server_util import running_server

import radixserve.frontend as rf
from radixserve.config import EngineConfig

pytestmark = pytest.mark.real_model

PAGE = 1  # so that cached_tokens can equal the shared prefix exactly (the cache is page-granular)


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    from radixserve.model.default_model import prepare_default_model

    config = EngineConfig(str(prepare_default_model(progress=False)), page_size=PAGE, kv_cache_gb=0.25)
    with running_server(config, "smollm") as base:
        yield base


@pytest.fixture(scope="module")
def client(url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=url, timeout=300) as c:
        yield c


def chat_prompt(question: str) -> str:
    return rf.ChatTemplate(CHAT_TEMPLATE).render([{"role": "user", "content": question}], "assistant")


def generate_many(client: httpx.Client, prompt: str, sampling: dict[str, Any], seeds: range) -> list[str]:
    def one(seed: int) -> str:
        r = client.post("/generate", json={"text": prompt, "sampling_params": {**sampling, "seed": seed}})
        assert r.status_code == 200, r.text
        return r.json()["text"]

    with ThreadPoolExecutor(len(seeds)) as pool:  # concurrent, so the server batches them
        return list(pool.map(one, seeds))


CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, "
    "trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)  # SmolLM2-135M-Instruct's own template


# -- 1-3: constrained outputs ------------------------------------------------------------------------------
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "hobbies"],
    "additionalProperties": False,
}


def test_json_schema_30_seeds_parse_and_validate(client: httpx.Client) -> None:
    prompt = chat_prompt("Invent a person. Answer in JSON with name, age, city and hobbies.")
    sampling = {"json_schema": json.dumps(PERSON), "temperature": 0.8, "max_new_tokens": 160}
    for text in generate_many(client, prompt, sampling, range(30)):
        jsonschema.validate(json.loads(text), PERSON)


def test_regex_outputs_full_match(client: httpx.Client) -> None:
    pattern = r"(0?[1-9]|1[0-2]):[0-5][0-9] (AM|PM)"
    prompt = chat_prompt("What time do you usually wake up?")
    for text in generate_many(
        client, prompt, {"regex": pattern, "temperature": 0.8, "max_new_tokens": 16}, range(10)
    ):
        assert re.fullmatch(pattern, text), text


def test_choices_output_is_one_of_them(client: httpx.Client) -> None:
    choices = ["Paris", "London", "Berlin", "a city I have never heard of"]
    prompt = chat_prompt("Which city is the capital of France?")
    outs = generate_many(
        client, prompt, {"choices": choices, "temperature": 0.8, "max_new_tokens": 16}, range(10)
    )
    assert all(o in choices for o in outs), outs


# -- 4: fork reuse -------------------------------------------------------------------------------------------
def test_fork_branches_reuse_the_shared_prefix(url: str, client: httpx.Client) -> None:
    doc = "The Amazon is the largest rainforest on Earth, spanning nine countries. " * 8
    system = "Answer from the document in a few words."

    @rf.function
    def qa(s: rf.ProgramState, questions: list[str]) -> None:
        s += rf.system(system) + rf.user(doc)
        forks = s.fork(len(questions))
        for f, q in zip(forks, questions, strict=True):
            f += rf.user(q) + rf.assistant(rf.gen("a", max_tokens=8, temperature=0))
        s["cached"] = [f.get_meta_info("a")["cached_tokens"] for f in forks]

    backend = rf.RuntimeEndpoint(url, chat_template=CHAT_TEMPLATE)
    state = qa.run(
        questions=["How large is it?", "How many countries?", "Is it a desert?", "Where is it?"],
        backend=backend,
    )
    shared = backend.chat_template.render(
        [{"role": "system", "content": system}, {"role": "user", "content": doc}]
    )
    r = client.post("/generate", json={"text": shared, "sampling_params": {"max_new_tokens": 1}})
    prefix_tokens = r.json()["meta_info"]["prompt_tokens"]
    assert prefix_tokens > 100 and all(c >= prefix_tokens for c in state["cached"]), (
        prefix_tokens,
        state["cached"],
    )


# -- 5: select ---------------------------------------------------------------------------------------------
def test_select_returns_the_highest_logprob_choice(url: str, client: httpx.Client) -> None:
    choices = ["Paris", "Lyon", "the city of Marseille"]

    @rf.function
    def capital(s: rf.ProgramState, method: Any) -> None:
        s += rf.user("What is the capital of France? Answer with the city name.")
        s += rf.assistant(rf.select("city", choices=choices, method=method))

    backend = rf.RuntimeEndpoint(url, chat_template=CHAT_TEMPLATE)
    prompt = chat_prompt("What is the capital of France? Answer with the city name.")
    base = client.post("/generate", json={"text": prompt, "sampling_params": {"max_new_tokens": 1}}).json()
    start = base["meta_info"]["prompt_tokens"]
    direct = {}
    for c in choices:
        r = client.post(
            "/generate",
            json={
                "text": prompt + c,
                "sampling_params": {"max_new_tokens": 1},
                "return_logprob": True,
                "logprob_start_len": start,
            },
        )
        direct[c] = [lp for lp, _ in r.json()["meta_info"]["input_token_logprobs"]]
    for method in ("total", "normalized"):
        scores = {c: sum(v) / (len(v) if method == "normalized" else 1) for c, v in direct.items()}
        state = capital.run(method=method, backend=backend)
        assert state["city"] == max(scores, key=lambda c: scores[c])
        assert state.get_meta_info("city")["scores"] == pytest.approx(scores, abs=1e-4)
    assert capital.run(method="total", backend=backend)["city"] == "Paris"


# -- 6: bad constraints ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("regex", "[0-9", "regex"),
        ("json_schema", '{"type": "objectx"}', "json_schema"),
        ("grammar", "start: nope", "grammar"),
    ],
)
def test_bad_constraint_is_400_naming_it_and_server_keeps_serving(
    client: httpx.Client, field: str, value: str, needle: str
) -> None:
    r = client.post("/generate", json={"text": "Hi", "sampling_params": {field: value, "max_new_tokens": 4}})
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    ok = client.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 2}})
    assert ok.status_code == 200


def test_bad_constraint_in_a_program_names_the_step(url: str) -> None:
    @rf.function
    def bad(s: rf.ProgramState) -> None:
        s += rf.user("Give a number.") + rf.assistant(rf.gen("n", regex="[0-9", max_tokens=4))

    with pytest.raises(rf.ProgramError, match=r"step 5 \(gen 'n'\): the server answered 400: .*regex"):
        bad.run(backend=rf.RuntimeEndpoint(url, chat_template=CHAT_TEMPLATE))
