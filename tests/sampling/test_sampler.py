"""The batched sampler: greedy and filtered sampling, penalties, masks, seeds and logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from radixserve.sampling.params import SamplingParams
from radixserve.sampling.sampler import Sampler, SamplingBatch, compute_prompt_logprobs

sampler = Sampler()


def make_batch(
    params: list[SamplingParams],
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    generators: list[torch.Generator | None] | None = None,
) -> SamplingBatch:
    n = len(params)
    return SamplingBatch.build(
        params,
        prompts if prompts is not None else [[] for _ in range(n)],
        outputs if outputs is not None else [[] for _ in range(n)],
        generators if generators is not None else [None] * n,
        "cpu",
    )


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_logits(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=seeded(seed)) * 3


def test_greedy_is_argmax_and_skips_logprobs_and_randomness() -> None:
    logits = random_logits(6, 50)
    generator = seeded(7)
    before_global, before_own = torch.get_rng_state(), generator.get_state()
    batch = make_batch([SamplingParams(temperature=0.0)] * 6, generators=[generator] + [None] * 5)
    out = sampler(logits, batch)
    assert batch.all_greedy
    assert torch.equal(out.tokens, logits.argmax(-1))
    assert out.logprobs is None and out.top_ids is None
    assert torch.equal(torch.get_rng_state(), before_global)
    assert torch.equal(generator.get_state(), before_own)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(top_k=1),
        SamplingParams(top_p=1e-6),
        SamplingParams(min_p=1.0),
        SamplingParams(temperature=1e-4),
    ],
)
def test_degenerate_filters_equal_greedy(params: SamplingParams) -> None:
    torch.manual_seed(0)
    for step in range(5):
        logits = random_logits(8, 64, seed=step)
        out = sampler(logits, make_batch([params] * 8))
        assert torch.equal(out.tokens, logits.argmax(-1))


def test_mixed_greedy_and_sampled_rows() -> None:
    torch.manual_seed(0)
    logits = random_logits(4, 32)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=5.0)] * 2
    tokens = sampler(logits, make_batch(params)).tokens
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()


def frequencies(logits_row: torch.Tensor, params: SamplingParams, draws: int = 20000) -> torch.Tensor:
    torch.manual_seed(1234)
    tokens = sampler(logits_row.expand(draws, -1), make_batch([params] * draws)).tokens
    return torch.bincount(tokens, minlength=logits_row.numel()).double()


def chi_square(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    expected = expected_probs.double() * observed.sum()
    keep = expected > 0
    return float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_temperature_sampling_matches_distribution(temperature: float) -> None:
    probs = torch.tensor([0.2, 0.3, 0.5])
    counts = frequencies(probs.log(), SamplingParams(temperature=temperature))
    expected = torch.softmax(probs.log() / temperature, dim=-1)
    assert chi_square(counts, expected) < 13.8  # chi-square, 2 degrees of freedom, p = 0.001


def test_top_k_and_top_p_restrict_support_and_renormalise() -> None:
    probs = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15])
    counts = frequencies(probs.log(), SamplingParams(top_k=2))
    expected = torch.tensor([0.0, 0.4, 0.0, 0.3, 0.0]) / 0.7
    assert counts[[0, 2, 4]].sum() == 0
    assert chi_square(counts, expected) < 10.8  # 1 degree of freedom
    # top_p=0.75: 0.4 + 0.3 leaves 0.3 < 0.75 unfilled, so 0.15 is the last token kept.
    counts = frequencies(probs.log(), SamplingParams(top_p=0.75))
    expected = torch.tensor([0.0, 0.4, 0.0, 0.3, 0.15]) / 0.85
    assert counts[[0, 2]].sum() == 0
    assert chi_square(counts, expected) < 13.8


def test_min_p_drops_tokens_below_fraction_of_best() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    counts = frequencies(probs.log(), SamplingParams(min_p=0.4))  # threshold 0.2
    assert counts[2] == 0 and counts[3] == 0
    assert chi_square(counts, torch.tensor([0.5, 0.3, 0.0, 0.0]) / 0.8) < 10.8


def run_steps(
    logits_per_step: list[torch.Tensor],
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> list[list[int]]:
    outputs: list[list[int]] = [[] for _ in params]
    for logits in logits_per_step:
        tokens = sampler(logits, make_batch(params, outputs=outputs, generators=generators)).tokens.tolist()
        for row, token in enumerate(tokens):
            outputs[row].append(token)
    return outputs


@pytest.mark.parametrize("target", [SamplingParams(temperature=0.8), SamplingParams(top_p=0.9, top_k=20)])
def test_seeded_row_is_reproducible_whatever_the_batch(target: SamplingParams) -> None:
    vocab, steps = 100, 6
    row_logits = [random_logits(1, vocab, seed=100 + s) for s in range(steps)]
    alone = run_steps(row_logits, [target], [seeded(42)])[0]

    others = [
        SamplingParams(temperature=0.0, repetition_penalty=1.3),
        SamplingParams(top_k=5, min_p=0.1, frequency_penalty=0.5),
        SamplingParams(temperature=1.5),
    ]
    placements: list[tuple[int, list[torch.Generator | None]]] = [
        (0, [seeded(1), None, seeded(2)]),
        (2, [None, None, None]),
        (3, [seeded(9)] * 3),
    ]
    for position, other_generators in placements:
        params = others[:position] + [target] + others[position:]
        generators = other_generators[:position] + [seeded(42)] + other_generators[position:]
        logits = [
            torch.cat(
                [random_logits(1, vocab, seed=500 + s)] * position
                + [row_logits[s]]
                + [random_logits(3 - position, vocab, seed=s)]
            )
            for s in range(steps)
        ]
        torch.manual_seed(position)  # the global stream differs between runs; the seeded row must not care
        in_batch = run_steps(logits, params, generators)[position]
        assert in_batch == alone

    assert run_steps(row_logits, [target], [seeded(43)])[0] != alone


def processed_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The logits after mask and penalties, read back through the full top-k logprobs."""
    out = sampler(logits, batch)
    assert out.top_ids is not None and out.top_logprobs is not None
    return torch.empty_like(logits).scatter_(1, out.top_ids, out.top_logprobs)


def test_penalties_follow_hf_and_openai_semantics() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]] * 3)
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=2.0, logprobs=4),
        SamplingParams(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.25, logprobs=4),
        SamplingParams(temperature=0.0, logprobs=4),
    ]
    batch = make_batch(params, prompts=[[0]] * 3, outputs=[[1, 1, 2]] * 3)
    assert batch.needs_penalties
    got = processed_logits(logits, batch)
    expected = torch.tensor(
        [
            [1.0, -2.0, 0.25, 3.0],  # prompt and output tokens: positive / 2, negative * 2
            [2.0, -1.0 - 2 * 0.5 - 0.25, 0.5 - 0.5 - 0.25, 3.0],  # output counts [0, 2, 1, 0]
            [2.0, -1.0, 0.5, 3.0],
        ]
    )
    torch.testing.assert_close(got, torch.log_softmax(expected, dim=-1))


def test_penalties_change_the_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    batch = make_batch([SamplingParams(temperature=0.0, presence_penalty=0.5)], outputs=[[0]])
    assert sampler(logits, batch).tokens.tolist() == [1]


def test_mask_forbids_tokens() -> None:
    torch.manual_seed(0)
    rows, vocab = 200, 16
    logits = random_logits(rows, vocab)
    mask = torch.zeros(rows, vocab, dtype=torch.bool)
    mask[:, [3, 7]] = True
    params = [SamplingParams(temperature=0.0, logprobs=0)] + [SamplingParams(temperature=3.0)] * (rows - 1)
    out = sampler(logits, make_batch(params), mask=mask)
    assert set(out.tokens.tolist()) == {3, 7}
    assert out.tokens[0] == (3 if logits[0, 3] > logits[0, 7] else 7)
    assert out.logprobs is not None
    # Logprobs are over the allowed tokens only.
    assert math.isclose(
        out.logprobs[0].exp().item(), torch.softmax(logits[0, [3, 7]], -1).max().item(), rel_tol=1e-5
    )


def test_logprobs_are_log_softmax_before_temperature() -> None:
    torch.manual_seed(0)
    logits = random_logits(4, 40)
    params = [
        SamplingParams(temperature=0.7, top_k=5, logprobs=3),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.3, logprobs=0),
        SamplingParams(temperature=0.0, logprobs=5),
    ]
    out = sampler(logits, make_batch(params))
    reference = torch.log_softmax(logits, dim=-1)
    assert out.logprobs is not None and out.top_ids is not None and out.top_logprobs is not None
    torch.testing.assert_close(out.logprobs, reference.gather(1, out.tokens[:, None]).squeeze(1))
    top_lps, top_ids = reference.topk(5, dim=-1)
    assert torch.equal(out.top_ids, top_ids)
    torch.testing.assert_close(out.top_logprobs, top_lps)

    per_row = out.token_logprobs([p.logprobs for p in params])
    assert per_row[1] is None
    first, third, fourth = per_row[0], per_row[2], per_row[3]
    assert first is not None and third is not None and fourth is not None
    assert first.token_id == out.tokens[0].item() and list(first.top) == top_ids[0, :3].tolist()
    assert third.top == {}
    assert len(fourth.top) == 5 and fourth.token_id == top_ids[3, 0].item()
    assert math.isclose(fourth.logprob, top_lps[3, 0].item(), rel_tol=1e-6)


def test_compute_prompt_logprobs() -> None:
    logits = random_logits(5, 30)
    token_ids = torch.tensor([4, 0, 29, 7, 7])
    reference = torch.log_softmax(logits, dim=-1)
    result = compute_prompt_logprobs(logits, token_ids, k=2)
    assert [r.token_id for r in result] == token_ids.tolist()
    for i, entry in enumerate(result):
        assert math.isclose(entry.logprob, reference[i, token_ids[i]].item(), rel_tol=1e-5)
        assert list(entry.top) == reference[i].topk(2).indices.tolist()
    assert all(r.top == {} for r in compute_prompt_logprobs(logits, token_ids, k=0))


def test_build_rejects_mismatched_lengths() -> None:
    with pytest.raises(ValueError):
        SamplingBatch.build([SamplingParams()], [[1]], [], [None], "cpu")


def test_logit_bias_and_min_tokens_change_only_their_rows() -> None:
    logits = random_logits(3, 50)
    before = logits.clone()
    worst = int(logits[0].argmin())
    top3 = logits[2].topk(3).indices.tolist()
    params = [
        SamplingParams(temperature=0, logit_bias={worst: 100.0}),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[top3[0]]),
    ]

    def build(row2_output: list[int]) -> SamplingBatch:
        return SamplingBatch.build(
            params, [[]] * 3, [[], [], row2_output], [None] * 3, "cpu", eos_token_ids=[top3[1]]
        )

    out = sampler(logits, build([7]))
    assert out.tokens.tolist() == [
        worst,
        int(logits[1].argmax()),
        top3[2],
    ]  # row 2: its stop token and EOS wait
    assert sampler(logits, build([7, 7])).tokens.tolist()[2] == top3[0]  # with 2 tokens they may end it
    assert torch.equal(logits, before)
    assert make_batch([SamplingParams(), SamplingParams(min_tokens=1, ignore_eos=True)]).bias is None


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (SamplingParams(logit_bias={10**6: 1.0}), "logit_bias"),
        (SamplingParams(logit_bias={1: 101.0}), "logit_bias"),
        (SamplingParams(max_tokens=4, min_tokens=5), "min_tokens"),
    ],
)
def test_bad_bias_and_min_tokens_name_their_field(params: SamplingParams, field: str) -> None:
    from radixserve.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError) as info:
        params.validate(vocab_size=1000)
    assert info.value.param == field
