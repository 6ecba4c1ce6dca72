"""One document, many questions: the DSL forks after the document, so it is prefilled once.

    radixserve serve &
    python examples/rag_pipeline.py --url http://127.0.0.1:8000

Each branch reports ``cached_tokens``: at least the shared prefix (system prompt + document), which
the fork sent once before the branches ran concurrently.
"""

from __future__ import annotations

import argparse

import radixserve.frontend as rf

DOCUMENT = """\
The radix tree in an inference server maps token prefixes to pages of the KV cache. When a new request
shares a prefix with an earlier one (a system prompt, a document, the earlier turns of a chat), the
server reuses the cached pages and computes attention keys and values only for the new tokens. Pages
no request holds are evicted least-recently-used first when memory runs short."""

QUESTIONS = [
    "What does the radix tree map?",
    "What is reused when prefixes match?",
    "Which tokens still need computing?",
    "Give an example of a shared prefix.",
    "When are pages evicted?",
    "In what order are pages evicted?",
    "What is stored in a page?",
    "Why does this make chats faster?",
]


@rf.function
def rag(s: rf.ProgramState, document: str, questions: list[str], max_tokens: int) -> None:
    s += rf.system("Answer in one short sentence, using only the document.") + rf.user(
        "Document:\n" + document
    )
    forks = s.fork(len(questions))
    for f, q in zip(forks, questions, strict=True):
        f += rf.user(q) + rf.assistant(rf.gen("answer", max_tokens=max_tokens, stop="\n", temperature=0))
    s["answers"] = [f["answer"] for f in forks]
    s["cached"] = [f.get_meta_info("answer")["cached_tokens"] for f in forks]
    s += rf.user("Is the document about computing?") + rf.assistant(
        rf.select("on_topic", choices=["yes", "no"])
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="the radixserve server")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--num-questions", type=int, default=len(QUESTIONS))
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args(argv)

    backend = rf.RuntimeEndpoint(args.url, api_key=args.api_key)
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.num_questions)]
    state = rag.run(document=DOCUMENT, questions=questions, max_tokens=args.max_tokens, backend=backend)
    for q, a, c in zip(questions, state["answers"], state["cached"], strict=True):
        print(f"Q: {q}\nA: {a.strip()}\n   (cached_tokens={c})")
    print(f"On topic: {state['on_topic']}")
    backend.close()


if __name__ == "__main__":
    main()
