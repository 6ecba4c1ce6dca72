"""The DSL (radixserve.frontend): interpreter logic on a scripted backend, then programs on the tiny model."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

import radixserve.frontend as rf
from radixserve.frontend.backends import ChatTemplate, Completion

PAGE = 4


class Scripted(rf.Backend):
    """Answers every gen with a fixed text and scores choices from a table; records what it was sent."""

    def __init__(self, answer: str = "ok", logprobs: dict[str, list[float]] | None = None) -> None:
        self.answer = answer
        self.logprobs = logprobs or {}
        self.prompts: list[str] = []
        self.prefixes: list[str] = []
        self.lock = threading.Lock()

    @property
    def chat_template(self) -> ChatTemplate:
        return ChatTemplate()

    def generate(
        self, prompt: str, sampling_params: dict[str, Any], on_text: Callable[[str], None] | None = None
    ) -> Completion:
        with self.lock:
            self.prompts.append(prompt)
        if on_text is not None:
            for ch in self.answer:
                on_text(ch)
        return Completion(self.answer, len(prompt), 0, len(self.answer), "stop")

    def cache_prefix(self, prompt: str) -> None:
        self.prefixes.append(prompt)

    def prompt_logprobs(self, prompt: str) -> list[tuple[int, float | None]]:
        raise AssertionError("score is overridden")

    def score(self, prompt: str, choices: Sequence[str]) -> list[list[float]]:
        return [self.logprobs[c] for c in choices]


@rf.function
def answer(s: rf.ProgramState, doc: str, questions: list[str]) -> None:
    s += rf.system("Answer from the document.") + rf.user(doc)
    forks = s.fork(len(questions))
    for f, q in zip(forks, questions, strict=True):
        f += rf.user(q) + rf.assistant(rf.gen("ans", max_tokens=8, stop="\n", temperature=0))
    s["answers"] = [f["ans"] for f in forks]
    s["cached"] = [f.get_meta_info("ans")["cached_tokens"] for f in forks]
    s["prompt_tokens"] = [f.get_meta_info("ans")["prompt_tokens"] for f in forks]
    s += rf.user("Is the document about science?") + rf.assistant(rf.select("yes_no", choices=["yes", "no"]))


# -- interpreter logic (scripted backend) ----------------------------------------------------------------
def test_program_text_forks_and_variables() -> None:
    be = Scripted("fine", {"yes": [-1.0], "no": [-0.5]})
    state = answer.run(doc="DOC", questions=["q1", "q2"], backend=be)
    assert state["answers"] == ["fine", "fine"] and state["yes_no"] == "no"
    shared = "<|im_start|>system\nAnswer from the document.<|im_end|>\n<|im_start|>user\nDOC<|im_end|>\n"
    assert be.prefixes == [shared]  # the shared prefix is sent once, before the branches
    assert sorted(be.prompts) == [
        shared + f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n" for q in ("q1", "q2")
    ]
    assert state.text() == shared + (
        "<|im_start|>user\nIs the document about science?<|im_end|>\n<|im_start|>assistant\nno<|im_end|>\n"
    )
    assert state.messages()[-1] == {"role": "assistant", "content": "no"}


@pytest.mark.parametrize(("method", "expected"), [("total", "yes"), ("normalized", "maybe so")])
def test_select_methods(method: Any, expected: str) -> None:
    be = Scripted(logprobs={"yes": [-1.0], "maybe so": [-0.6, -0.6], "no": [-3.0]})

    @rf.function
    def pick(s: rf.ProgramState) -> None:
        s += "Q: ?\nA: " + rf.select("a", choices=["yes", "maybe so", "no"], method=method)

    state = pick.run(backend=be)
    assert state["a"] == expected and state.text() == "Q: ?\nA: " + expected
    assert state.get_meta_info("a")["scores"]["maybe so"] == pytest.approx(
        -1.2 if method == "total" else -0.6
    )


def test_streaming_yields_the_whole_text() -> None:
    @rf.function
    def chat(s: rf.ProgramState) -> None:
        s += rf.system("Be brief.") + rf.user("Hi") + rf.assistant(rf.gen("a", max_tokens=8))
        s += rf.user("Pick") + rf.assistant(rf.select("p", choices=["yes", "no"]))

    state = chat.run(backend=Scripted("streamed answer", {"yes": [-1.0], "no": [-2.0]}), stream=True)
    chunks = list(state.text_iter())
    assert "".join(chunks) == state.text() and state["p"] == "yes"
    assert chunks.count("s") >= 2  # the gen's deltas arrive one by one, not batched up


def test_run_batch_keeps_order() -> None:
    @rf.function
    def echo(s: rf.ProgramState, x: str) -> None:
        s += rf.user(x) + rf.assistant(rf.gen("g", max_tokens=2))
        s["x"] = x

    states = echo.run_batch(
        [{"x": str(i)} for i in range(10)], backend=Scripted(), num_threads=4, progress_bar=True
    )
    assert [s["x"] for s in states] == [str(i) for i in range(10)]


def test_missing_variable_names_the_step() -> None:
    @rf.function
    def bad(s: rf.ProgramState) -> None:
        s += rf.user("hi") + rf.assistant(rf.gen("greeting", max_tokens=2))
        s["answer"]  # noqa: B018 (the read is the test)

    with pytest.raises(
        rf.ProgramError,
        match=r"after step 6 \(end of assistant\): no variable named 'answer' \(defined: greeting\)",
    ):
        bad.run(backend=Scripted())


def test_nested_roles_are_an_error_naming_the_step() -> None:
    @rf.function
    def bad(s: rf.ProgramState) -> None:
        s += rf.user("a" + rf.assistant("b"))

    with pytest.raises(
        rf.ProgramError, match=r"step 3 \(assistant\): cannot start an? assistant message inside the user"
    ):
        bad.run(backend=Scripted())


def test_failure_in_a_fork_names_the_fork() -> None:
    class Failing(Scripted):
        def generate(
            self, prompt: str, sampling_params: dict[str, Any], on_text: Callable[[str], None] | None = None
        ) -> Completion:
            if "q2" in prompt:
                raise rf.BackendError("boom")
            return super().generate(prompt, sampling_params, on_text)

    with pytest.raises(rf.ProgramError, match=r"step \d+ \(gen 'ans' in fork 2/2\): boom"):
        answer.run(doc="D", questions=["q1", "q2"], backend=Failing(logprobs={"yes": [0.0], "no": [0.0]}))


def test_unreachable_server_names_the_step() -> None:
    @rf.function
    def one(s: rf.ProgramState) -> None:
        s += "Hello" + rf.gen("x", max_tokens=2)

    with pytest.raises(rf.ProgramError, match=r"step 2 \(gen 'x'\): cannot reach http://127\.0\.0\.1:9"):
        one.run(backend=rf.RuntimeEndpoint("http://127.0.0.1:9", timeout=2))


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="at most one"):
        rf.gen("x", regex="a", choices=["a"])
    with pytest.raises(ValueError, match="non-empty"):
        rf.select("x", choices=[])
    with pytest.raises(rf.ProgramError, match="no backend"):
        answer.run(doc="d", questions=[])


def test_chat_template_open_role_is_a_prefix_of_the_closed_message() -> None:
    t = ChatTemplate()
    msgs = [{"role": "user", "content": "hi"}]
    opened = t.render(msgs, "assistant")
    assert opened.endswith("<|im_start|>assistant\n")
    assert t.render([*msgs, {"role": "assistant", "content": "yo"}]).startswith(opened + "yo")


# -- on the tiny model, in process ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tiny_llama: Path) -> Iterator[rf.LocalEngine]:
    be = rf.LocalEngine(str(tiny_llama), num_pages=512, page_size=PAGE, enforce_eager=True)
    yield be
    be.close()


def test_answer_program_on_the_engine(engine: rf.LocalEngine) -> None:
    questions = ["What is it?", "Who wrote it?", "When?"]
    doc = "The quick brown fox jumps over the lazy dog. " * 6
    state = answer.run(doc=doc, questions=questions, backend=engine)
    assert len(state["answers"]) == 3 and state["yes_no"] in ("yes", "no")
    shared = engine.engine.tokenize(
        engine.chat_template.render(
            [{"role": "system", "content": "Answer from the document."}, {"role": "user", "content": doc}]
        )
    )
    assert all(c >= len(shared) // PAGE * PAGE for c in state["cached"])  # the forks reused the shared prefix
    assert all(p > len(shared) for p in state["prompt_tokens"])


def test_select_matches_direct_logprobs(engine: rf.LocalEngine) -> None:
    @rf.function
    def pick(s: rf.ProgramState, method: Any) -> None:
        s += rf.user("Pick a colour.") + rf.assistant(
            rf.select("c", choices=["red", "green", "blue sky"], method=method)
        )

    for method in ("total", "normalized"):
        state = pick.run(method=method, backend=engine)
        prompt = engine.chat_template.render([{"role": "user", "content": "Pick a colour."}], "assistant")
        base = len(engine.engine.tokenize(prompt))
        direct = {}
        for c in ("red", "green", "blue sky"):
            lps = [lp for _, lp in engine.prompt_logprobs(prompt + c)[base:]]
            direct[c] = sum(lps) / (len(lps) if method == "normalized" else 1)  # type: ignore[arg-type]
        assert state["c"] == max(direct, key=lambda k: direct[k])
        assert state.get_meta_info("c")["scores"] == pytest.approx(direct)


def test_streaming_on_the_engine(engine: rf.LocalEngine) -> None:
    @rf.function
    def chat(s: rf.ProgramState) -> None:
        s += rf.user("Say something.") + rf.assistant(rf.gen("a", max_tokens=12, temperature=0))

    state = chat.run(backend=engine, stream=True)
    assert "".join(state.text_iter()) == state.text()
    assert state.get_meta_info("a")["completion_tokens"] >= 1


def test_engine_error_names_the_step(engine: rf.LocalEngine) -> None:
    @rf.function
    def too_long(s: rf.ProgramState) -> None:
        s += rf.user("x") + rf.assistant(rf.gen("a", max_tokens=100_000))

    with pytest.raises(
        rf.ProgramError,
        match=r"step 5 \(gen 'a'\): the engine rejected the request: .*maximum context length",
    ):
        too_long.run(backend=engine)


@pytest.mark.parametrize("page_size", [1, PAGE])
def test_select_after_a_long_prompt_computes_the_prompt_once_and_the_choices(
    tmp_path_factory: pytest.TempPathFactory, page_size: int
) -> None:
    """Issue 24: the choices reuse the prompt's cached KV and logprobs, so each costs its own tokens (and,
    with pages of several tokens, the rest of the prompt's last page)."""
    from tiny_models import make_tiny_model

    model = make_tiny_model(tmp_path_factory.mktemp("long"), "llama", context=2048)
    be = rf.LocalEngine(str(model), num_pages=4096, page_size=page_size, enforce_eager=True)
    try:
        doc = " ".join(f"item {i} of the list is {i * 7 % 13}." for i in range(22))
        choices = ["red", "green", "blue sky", "a very dark shade of purple"]

        @rf.function
        def pick(s: rf.ProgramState) -> None:
            s += rf.user(doc) + rf.assistant(rf.select("c", choices=choices))

        prompt = be.chat_template.render([{"role": "user", "content": doc}], "assistant")
        base = be.engine.tokenize(prompt)
        assert 450 <= len(base) <= 700
        own = 0  # the tokens of each choice: those after its common prefix with the prompt's
        for c in choices:
            ids = be.engine.tokenize(prompt + c)
            k = next((i for i, (a, b) in enumerate(zip(base, ids)) if a != b), min(len(base), len(ids)))
            own += len(ids) - k + (k - k // page_size * page_size)  # and its first page's cached part
        before = be.engine.stats().prompt_tokens
        state = pick.run(backend=be)
        assert state["c"] in choices
        computed = be.engine.stats().prompt_tokens - before
        assert computed <= len(base) + own, (computed, len(base), own)
        if page_size == 1:
            assert computed == len(base) + own
    finally:
        be.close()
