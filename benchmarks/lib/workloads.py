"""Reproducible benchmark workloads built from real prose that ships with Python.

The text is the Python reference documentation that CPython ships as ``pydoc_data.topics`` (the
``help()`` topics: ~460 kB of English prose written by the CPython documentation authors). It is cut
into paragraphs, tokenized once with the target model's tokenizer, and every prompt piece is a run of
whole tokens starting at a paragraph boundary, so prompt lengths are calibrated in that tokenizer's
tokens rather than in characters.

Invariants:
- The same (spec, tokenizer, Python version) gives the same workload: every random choice comes from
  one ``random.Random(spec.seed)``.
- A workload is a list of sessions; a session is a list of turns. Turn k of a session is sent only
  after turn k-1's answer came back, and its messages contain every earlier turn and answer.
- Sharing is explicit per workload: RAG requests share a document per group, few-shot requests share
  one examples block, multi-turn turns share their own conversation's history, and no-sharing and
  mixed-length requests start with distinct paragraphs (only the chat template's header is common).
"""

from __future__ import annotations

import random
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Any

WORKLOADS = ("rag", "multiturn", "fewshot", "nosharing", "mixed")
SOURCE = f"pydoc_data.topics of Python {sys.version.split()[0]} (the Python reference documentation)"


@dataclass(frozen=True)
class WorkloadSpec:
    """Sizes of every workload kind; each kind reads only the fields it needs."""

    name: str = "rag"
    seed: int = 0
    output_tokens: int = 64
    # rag: num_docs documents of doc_tokens, each asked questions_per_doc questions
    num_docs: int = 4
    questions_per_doc: int = 4
    doc_tokens: int = 1024
    # multiturn: num_sessions conversations of `turns` user turns of turn_tokens each
    num_sessions: int = 8
    turns: int = 4
    turn_tokens: int = 128
    # fewshot: num_examples shared examples of example_tokens each, then a fresh query
    num_examples: int = 8
    example_tokens: int = 96
    # nosharing / mixed / fewshot: num_requests independent requests of prompt_tokens each
    num_requests: int = 16
    prompt_tokens: int = 512
    # mixed: short chat turns of short_tokens; this fraction carry a long document of long_tokens instead
    short_tokens: int = 64
    long_fraction: float = 0.25
    long_tokens: int = 2048


@dataclass(frozen=True)
class Turn:
    user: str
    max_tokens: int
    kind: str


@dataclass
class Session:
    turns: list[Turn]
    answers: list[str] = field(default_factory=list)

    def messages(self, k: int) -> list[dict[str, str]]:
        """The chat messages of turn k: every earlier turn with its answer, then turn k."""
        out: list[dict[str, str]] = []
        for turn, answer in zip(self.turns[:k], self.answers[:k], strict=True):
            out.append({"role": "user", "content": turn.user})
            out.append({"role": "assistant", "content": answer})
        out.append({"role": "user", "content": self.turns[k].user})
        return out


@dataclass
class Workload:
    spec: WorkloadSpec
    sessions: list[Session]

    @property
    def num_turns(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    def describe(self) -> dict[str, Any]:
        return {
            "spec": asdict(self.spec),
            "sessions": len(self.sessions),
            "turns": self.num_turns,
            "source": SOURCE,
        }


class Corpus:
    """The reference-documentation paragraphs as one token stream with paragraph start offsets."""

    def __init__(self, tokenizer: Any) -> None:
        from pydoc_data.topics import topics

        self.tokenizer = tokenizer
        self.paragraphs: list[str] = []
        self.topic_of: list[str] = []
        for key in sorted(topics):
            for para in topics[key].split("\n\n"):
                text = " ".join(para.split())
                if len(text) >= 80:  # headings, rules and one-line fragments make poor prose
                    self.paragraphs.append(text)
                    self.topic_of.append(key)

    @cached_property
    def _stream(self) -> tuple[list[int], list[int]]:
        encoded = self.tokenizer(self.paragraphs, add_special_tokens=False)["input_ids"]
        sep = self.tokenizer("\n\n", add_special_tokens=False)["input_ids"]
        ids: list[int] = []
        starts: list[int] = []
        for para_ids in encoded:
            starts.append(len(ids))
            ids.extend(para_ids)
            ids.extend(sep)
        return ids, starts

    def text(self, paragraph: int, num_tokens: int) -> str:
        """``num_tokens`` tokens of prose starting at paragraph ``paragraph`` (wrapping at the end)."""
        ids, starts = self._stream
        start = starts[paragraph % len(starts)]
        window = (
            (ids + ids)[start : start + num_tokens]
            if start + num_tokens > len(ids)
            else ids[start : start + num_tokens]
        )
        return str(self.tokenizer.decode(window)).strip()

    def phrase(self, rng: random.Random, text: str, words: int = 6) -> str:
        w = text.split()
        i = rng.randrange(max(1, len(w) - words))
        return " ".join(w[i : i + words])

    def distinct_paragraphs(self, rng: random.Random, n: int) -> list[int]:
        """n paragraph indices, all different while the corpus has enough of them."""
        pool = list(range(len(self.paragraphs)))
        out: list[int] = []
        while len(out) < n:
            rng.shuffle(pool)
            out.extend(pool[: n - len(out)])
        return out


def _interleave(groups: Sequence[Sequence[Session]]) -> list[Session]:
    """Round-robin over groups, so requests sharing a prefix are spread across the run."""
    out: list[Session] = []
    for i in range(max((len(g) for g in groups), default=0)):
        out.extend(g[i] for g in groups if i < len(g))
    return out


def _rag(spec: WorkloadSpec, corpus: Corpus, rng: random.Random) -> list[Session]:
    groups = []
    for para in corpus.distinct_paragraphs(rng, spec.num_docs):
        doc = corpus.text(para, spec.doc_tokens)
        group = []
        for _ in range(spec.questions_per_doc):
            question = (
                f'Using only the document above, explain what it says about "{corpus.phrase(rng, doc)}".'
            )
            group.append(Session([Turn(f"Document:\n{doc}\n\n{question}", spec.output_tokens, "rag")]))
        groups.append(group)
    return _interleave(groups)


def _multiturn(spec: WorkloadSpec, corpus: Corpus, rng: random.Random) -> list[Session]:
    paras = corpus.distinct_paragraphs(rng, spec.num_sessions * spec.turns)
    sessions = []
    for s in range(spec.num_sessions):
        turns = []
        for t in range(spec.turns):
            passage = corpus.text(paras[s * spec.turns + t], spec.turn_tokens)
            ask = (
                "Explain this passage in simpler words."
                if t == 0
                else "How does this relate to what we discussed?"
            )
            turns.append(Turn(f"{passage}\n\n{ask}", spec.output_tokens, "chat"))
        sessions.append(Session(turns))
    return sessions


def _fewshot(spec: WorkloadSpec, corpus: Corpus, rng: random.Random) -> list[Session]:
    paras = corpus.distinct_paragraphs(rng, spec.num_examples + spec.num_requests)
    examples = "".join(
        f"Passage: {corpus.text(p, spec.example_tokens)}\nTopic: {corpus.topic_of[p]}\n\n"
        for p in paras[: spec.num_examples]
    )
    header = "Name the Python documentation topic of each passage.\n\n" + examples
    return [
        Session(
            [
                Turn(
                    f"{header}Passage: {corpus.text(p, spec.example_tokens)}\nTopic:",
                    spec.output_tokens,
                    "fewshot",
                )
            ]
        )
        for p in paras[spec.num_examples :]
    ]


def _nosharing(spec: WorkloadSpec, corpus: Corpus, rng: random.Random) -> list[Session]:
    return [
        Session(
            [
                Turn(
                    f"{corpus.text(p, spec.prompt_tokens)}\n\nSummarize the text above.",
                    spec.output_tokens,
                    "unique",
                )
            ]
        )
        for p in corpus.distinct_paragraphs(rng, spec.num_requests)
    ]


def _mixed(spec: WorkloadSpec, corpus: Corpus, rng: random.Random) -> list[Session]:
    sessions = []
    for p in corpus.distinct_paragraphs(rng, spec.num_requests):
        if rng.random() < spec.long_fraction:
            turn = Turn(
                f"Document:\n{corpus.text(p, spec.long_tokens)}\n\nSummarize the document above.",
                spec.output_tokens,
                "long",
            )
        else:
            turn = Turn(
                f"{corpus.text(p, spec.short_tokens)}\n\nWhat is this about?", spec.output_tokens, "short"
            )
        sessions.append(Session([turn]))
    return sessions


_BUILDERS = {
    "rag": _rag,
    "multiturn": _multiturn,
    "fewshot": _fewshot,
    "nosharing": _nosharing,
    "mixed": _mixed,
}


def build_workload(spec: WorkloadSpec, tokenizer: Any, corpus: Corpus | None = None) -> Workload:
    """The sessions of ``spec.name``, reproducible from ``spec.seed``."""
    if spec.name not in _BUILDERS:
        raise ValueError(f"unknown workload {spec.name!r}; choose from {', '.join(WORKLOADS)}")
    corpus = corpus or Corpus(tokenizer)
    return Workload(spec, _BUILDERS[spec.name](spec, corpus, random.Random(spec.seed)))


def load_tokenizer(model_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def prose(tokenizer: object, n_tokens: int, seed: int) -> str:
    """About ``n_tokens`` of real prose shipped with Python (the reference docs in pydoc_data)."""
    from pydoc_data.topics import topics

    keys = sorted(topics)
    random.Random(seed).shuffle(keys)
    text, count = "", 0
    for k in keys:
        text += topics[k] + "\n"
        count = len(tokenizer.encode(text))  # type: ignore[attr-defined]
        if count >= n_tokens:
            break
    ids = tokenizer.encode(text)[:n_tokens]  # type: ignore[attr-defined]
    return tokenizer.decode(ids)  # type: ignore[attr-defined,no-any-return]
