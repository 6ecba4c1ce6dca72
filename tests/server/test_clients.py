"""Real clients against a real server, unchanged: LangChain (``langchain-openai``) with bound tools, streaming
and the batched ``OpenAI`` LLM; EleutherAI lm-evaluation-harness (``local-completions`` with its default
tokenized requests) on a local task, whose loglikelihoods equal our own /v1/completions echo logprobs and
are the same with the prefix cache on and off (prompt logprobs reuse cached prefixes). Tiny Qwen2 with
Qwen2.5's template; nothing is downloaded."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field, SecretStr
from server_util import MODEL_NAME, client_package, serving, tool_server

from radixserve.config import EngineConfig


class GetWeather(BaseModel):
    """Get the weather forecast for a city."""

    city: Literal["Paris", "Rome", "Oslo"] = Field(description="the city")
    days: int = Field(ge=1, le=7, description="how many days ahead")


@pytest.fixture(scope="module")
def url(tool_model: Path) -> Iterator[str]:
    with tool_server(tool_model) as base:
        yield base


# -- LangChain ------------------------------------------------------------------------------------
@pytest.fixture()
def chat_model(url: str) -> Any:
    chat_openai = client_package("langchain_openai").ChatOpenAI
    return chat_openai(
        model=MODEL_NAME,
        base_url=f"{url}/v1",
        api_key=SecretStr("unused"),
        temperature=0,
        max_completion_tokens=120,
        max_retries=0,
        timeout=120,
    )


def test_langchain_bound_tools_return_calls_that_follow_the_schema(chat_model: Any) -> None:
    bound = chat_model.bind_tools(
        [GetWeather], tool_choice="any", parallel_tool_calls=False
    )  # "any": required
    reply = bound.invoke("What will the weather be in Paris?")
    [call] = reply.tool_calls
    assert call["name"] == "GetWeather" and call["id"]
    jsonschema.validate(call["args"], GetWeather.model_json_schema())
    GetWeather(**call["args"])
    assert reply.response_metadata["finish_reason"] == "tool_calls"
    chunks = list(bound.stream("What will the weather be in Paris?"))
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged = merged + chunk
    assert [(c["name"], c["args"]) for c in merged.tool_calls] == [(call["name"], call["args"])]


def test_langchain_stream_joins_to_the_whole_reply(chat_model: Any) -> None:
    whole = chat_model.invoke("Say hello.", max_tokens=12).content
    pieces = [chunk.content for chunk in chat_model.stream("Say hello.", max_tokens=12)]
    assert len([p for p in pieces if p]) > 1 and "".join(pieces) == whole


def test_langchain_openai_llm_sends_a_batch_of_prompts(url: str) -> None:
    sent: list[Any] = []

    def record(request: httpx.Request) -> None:
        sent.append(json.loads(request.content)["prompt"])

    llm = client_package("langchain_openai").OpenAI(
        model=MODEL_NAME,
        base_url=f"{url}/v1",
        api_key=SecretStr("unused"),
        temperature=0,
        max_tokens=5,
        max_retries=0,
        http_client=httpx.Client(timeout=120, event_hooks={"request": [record]}),
    )
    prompts = ["Once upon a time", "The quick brown fox", "héllo wörld"]
    batch = llm.generate(prompts)
    assert sent == [prompts]  # one request whose prompt is the list
    assert [g[0].text for g in batch.generations] == [llm.invoke(p) for p in prompts]


# -- lm-evaluation-harness ------------------------------------------------------------------------
MC = [
    {"question": "The capital of France is", "choices": ["Paris", "Rome", "Oslo"], "answer": 0},
    {"question": "The quick brown", "choices": ["fox", "dog"], "answer": 0},
    {"question": "héllo", "choices": ["wörld", "again"], "answer": 0},
]
GEN = [{"prompt": "Once upon a time", "target": "x"}, {"prompt": "The quick brown fox", "target": "y"}]
# task name -> (rows, the task YAML after its data source)
TASKS: dict[str, tuple[list[dict[str, Any]], str]] = {
    "radixserve_mc": (
        MC,
        'output_type: multiple_choice\ndoc_to_text: "{{question}}"\n'
        'doc_to_choice: "{{choices}}"\ndoc_to_target: answer\nmetric_list:\n  - metric: acc\n',
    ),
    "radixserve_gen": (
        GEN,
        'output_type: generate_until\ndoc_to_text: "{{prompt}}"\n'
        'doc_to_target: "{{target}}"\ngeneration_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 8\n'
        "  do_sample: false\nmetric_list:\n  - metric: exact_match\n",
    ),
}


def write_tasks(folder: Path) -> None:
    """Two tasks on local JSON lines: lm-eval's own loader, nothing from the hub."""
    for name, (rows, rest) in TASKS.items():
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(row) + "\n" for row in rows))
        head = (
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n"
            f"  data_files:\n    test: {data}\ntest_split: test\n"
        )
        (folder / f"{name}.yaml").write_text(head + rest)


def own_tasks(folder: Path) -> Any:
    """lm-eval's task manager over the tasks ``write_tasks`` wrote, and no others: indexing lm-eval's own
    ~15,000 task files, which these tests do not use, took seconds each time."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(folder), include_defaults=False)


def test_lm_eval_local_completions_runs_and_agrees_with_our_logprobs(
    url: str, tool_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    lm_eval = client_package("lm_eval")
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    write_tasks(tmp_path)
    lm = LocalCompletionsAPI(
        base_url=f"{url}/v1/completions",
        model=MODEL_NAME,
        tokenizer=str(tool_model),
        tokenizer_backend="huggingface",
        max_length=2048,
        max_retries=1,
    )
    assert lm.tokenized_requests  # the default: prompts go as lists of token lists
    results = lm_eval.simple_evaluate(
        model=lm, tasks=list(TASKS), task_manager=own_tasks(tmp_path), log_samples=True
    )
    assert results is not None
    samples = results["samples"]
    assert len(samples["radixserve_mc"]) == len(MC) and len(samples["radixserve_gen"]) == len(GEN)
    with httpx.Client(base_url=url, timeout=120) as c:
        for sample in samples["radixserve_mc"]:
            for (context, continuation), [(loglik, _)] in zip(
                sample["arguments"], sample["resps"], strict=True
            ):
                ctx, cont = lm._encode_pair(context, continuation)
                body = {
                    "model": MODEL_NAME,
                    "prompt": [ctx + cont],
                    "max_tokens": 0,
                    "echo": True,
                    "logprobs": 1,
                }
                ours = c.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]["token_logprobs"]
                assert loglik == pytest.approx(sum(ours[len(ctx) :]), abs=1e-5)
        for sample in samples["radixserve_gen"]:
            [(context, kwargs)] = sample["arguments"]
            body = {
                "model": MODEL_NAME,
                "prompt": context,
                "max_tokens": kwargs["max_gen_toks"],
                "temperature": 0,
                "stop": kwargs["until"],
            }
            assert sample["resps"] == [[c.post("/v1/completions", json=body).json()["choices"][0]["text"]]]


# -- lm-eval with the prefix cache on and off (issue 24) -----------------------------------------


def _evaluate(url: str, tokenizer: Path, tasks: Path) -> dict[str, list[dict[str, Any]]]:
    lm_eval = client_package("lm_eval")
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    lm = LocalCompletionsAPI(
        base_url=f"{url}/v1/completions",
        model=MODEL_NAME,
        tokenizer=str(tokenizer),
        tokenizer_backend="huggingface",
        max_length=2048,
        max_retries=1,
    )
    results = lm_eval.simple_evaluate(
        model=lm, tasks=list(TASKS), task_manager=own_tasks(tasks), log_samples=True
    )
    assert results is not None
    return results["samples"]


def test_lm_eval_loglikelihoods_equal_with_the_cache_on_and_off(
    tool_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    write_tasks(tmp_path)
    runs, hits = {}, {}
    for cache in (True, False):
        config = EngineConfig(str(tool_model), page_size=4, num_pages=2048, prefix_cache=cache)
        with serving(config) as served:
            runs[cache] = _evaluate(served.url, tool_model, tmp_path)
            hits[cache] = served.engine.stats().prefix_hit_tokens
    assert hits[True] > 0 and hits[False] == 0  # the choices of an item reused its context
    for task in TASKS:
        on, off = runs[True][task], runs[False][task]
        assert len(on) == len(off) == len(TASKS[task][0])
        for a, b in zip(on, off, strict=True):
            assert a["arguments"] == b["arguments"]
            if TASKS[task][1].startswith("output_type: multiple_choice"):
                for [(ll_a, greedy_a)], [(ll_b, greedy_b)] in zip(a["resps"], b["resps"], strict=True):
                    assert ll_a == pytest.approx(ll_b, abs=1e-5) and greedy_a == greedy_b
            else:
                assert a["resps"] == b["resps"]
