"""Write the 1B benchmark model (Llama-3.2-1B's dimensions, random weights, SmolLM2's tokenizer) into
the cache once and print its folder; ``--gguf`` also writes its GGUF form. The builder is
``benchmarks/lib/bench_models.py``.

    python -m benchmarks.step.big_model [--seed 0] [--gguf Q8_0|Q4_1]
"""

from __future__ import annotations

import argparse

from benchmarks.lib.bench_models import LLAMA_1B, build, build_gguf


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gguf", default=None, choices=("Q8_0", "Q4_1"), help="also write its GGUF form")
    args = parser.parse_args()
    folder = build(LLAMA_1B, args.seed)
    print(folder)
    if args.gguf:
        print(build_gguf(folder, args.gguf))


if __name__ == "__main__":
    main()
