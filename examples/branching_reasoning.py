"""Nested forks and select: several approaches, each drafted twice, each draft judged, then a verdict.

    radixserve serve &
    python examples/branching_reasoning.py --url http://127.0.0.1:8000

Every level of the tree shares the text above it, so the radix cache holds the question once, each
approach once, and the drafts add only their own tokens.
"""

from __future__ import annotations

import argparse

import radixserve.frontend as rf

APPROACHES = ["Reason step by step.", "Work backwards from the answer.", "Estimate first, then check."]


@rf.function
def tree(s: rf.ProgramState, question: str, drafts: int, max_tokens: int) -> None:
    s += rf.system("You solve problems carefully.") + rf.user(question)
    branches = []
    for a, hint in zip(s.fork(len(APPROACHES)), APPROACHES, strict=True):
        a += rf.assistant(hint)
        drafts_of_a = a.fork(drafts)  # a second level: each draft shares the question and the approach
        for d in drafts_of_a:
            d += rf.user("Draft an answer.") + rf.assistant(
                rf.gen("draft", max_tokens=max_tokens, temperature=0.8)
            )
            d += rf.user("Is that draft correct?") + rf.assistant(rf.select("ok", choices=["yes", "no"]))
        branches.append((hint, drafts_of_a))
    s["drafts"] = [(hint, d["draft"], d["ok"]) for hint, ds in branches for d in ds]
    s += rf.user("Should we trust the majority of these drafts?")
    s += rf.assistant(rf.select("verdict", choices=["yes", "no", "unsure"], method="total"))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="the radixserve server")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--drafts", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument(
        "--question", default="A train leaves at 9:40 and arrives at 11:15. How long is the trip?"
    )
    args = ap.parse_args(argv)

    backend = rf.RuntimeEndpoint(args.url, api_key=args.api_key)
    state = tree.run(question=args.question, drafts=args.drafts, max_tokens=args.max_tokens, backend=backend)
    for hint, draft, ok in state["drafts"]:
        print(f"[{hint}] ({'judged correct' if ok == 'yes' else 'judged wrong'})\n  {draft.strip()}")
    print(f"Verdict: {state['verdict']}")
    backend.close()


if __name__ == "__main__":
    main()
