"""Multi-turn chat with SSE streaming through the ``openai`` client; prints the cached prompt tokens each
turn.

    radixserve serve &
    python examples/chat_client.py --url http://127.0.0.1:8000

Every turn resends the whole conversation; the server's radix cache recognises the earlier turns, so
``cached_tokens`` grows with the conversation while only the new turn is prefilled.
"""

from __future__ import annotations

import argparse
from typing import Any

from openai import OpenAI

TURNS = [
    "Hi! In one sentence, what is a radix tree?",
    "How is it different from a plain trie?",
    "Give one use of it in an inference server.",
]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="the radixserve server")
    ap.add_argument("--api-key", default="none")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--turns", type=int, default=len(TURNS))
    args = ap.parse_args(argv)

    client = OpenAI(base_url=args.url.rstrip("/") + "/v1", api_key=args.api_key)
    model = client.models.list().data[0].id
    messages: list[Any] = [{"role": "system", "content": "You are a concise assistant."}]
    for i in range(args.turns):
        question = TURNS[i % len(TURNS)]
        messages.append({"role": "user", "content": question})
        print(f"\n[user] {question}\n[assistant] ", end="", flush=True)
        reply, cached, prompt = "", 0, 0
        stream = client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=args.max_tokens,
            temperature=0.7,
            stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                reply += chunk.choices[0].delta.content
                print(chunk.choices[0].delta.content, end="", flush=True)
            if chunk.usage is not None:
                prompt = chunk.usage.prompt_tokens
                details = chunk.usage.prompt_tokens_details
                cached = (details.cached_tokens or 0) if details is not None else 0
        print(f"\n  (turn {i + 1}: prompt_tokens={prompt} cached_tokens={cached})")
        messages.append({"role": "assistant", "content": reply})


if __name__ == "__main__":
    main()
