"""Pull records out of free text with a JSON schema: the server constrains decoding, so the output parses.

radixserve serve &
python examples/json_extraction.py --url http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import json

import radixserve.frontend as rf

TEXTS = [
    "Maria Lopez, 34, moved from Madrid to Berlin last spring to work as a nurse.",
    "The new intern is Tom Becker; he is 22 and lives in Hamburg.",
    "Aiko Tanaka (41) runs a bakery in Osaka with her brother.",
]

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z .'-]{1,24}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "city": {"type": "string", "pattern": "^[A-Za-z .'-]{1,24}$"},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


@rf.function
def extract(s: rf.ProgramState, text: str) -> None:
    s += rf.system("Extract the person as JSON with keys name, age and city.")
    s += rf.user(text) + rf.assistant(rf.gen("record", max_tokens=128, json_schema=SCHEMA, temperature=0))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="the radixserve server")
    ap.add_argument("--api-key", default=None)
    args = ap.parse_args(argv)

    backend = rf.RuntimeEndpoint(args.url, api_key=args.api_key)
    states = extract.run_batch([{"text": t} for t in TEXTS], backend=backend, num_threads=len(TEXTS))
    for text, state in zip(TEXTS, states, strict=True):
        record = json.loads(state["record"])  # fails loudly if the server did not constrain the output
        assert set(record) == {"name", "age", "city"}, record
        print(f"{text}\n  -> {record}")
    backend.close()


if __name__ == "__main__":
    main()
