"""ScoreTable (cache/scores.py): what each position predicted, read back as the logprob of the token
after it; unknown wherever nothing was stored, the slot was rewritten, or the token is not covered."""

from __future__ import annotations

import math

import torch

from radixserve.cache.scores import MAX_ROWS, TOP_K, ScoreTable

PS, VOCAB = 4, 50


def _table() -> tuple[ScoreTable, torch.Tensor]:
    torch.manual_seed(0)
    table = ScoreTable(8, PS)
    logprobs = torch.log_softmax(torch.randn(PS, VOCAB) * 3, dim=-1)
    return table, logprobs


def test_stored_positions_read_back_by_token_and_unknown_elsewhere() -> None:
    table, lps = _table()
    tokens = [1, 2, 3, 4, 5]  # page 2 holds positions 0..3; the writer's next token after 3 was 5
    table.store(torch.arange(2 * PS, 3 * PS), lps, torch.tensor([2, 3, 4, 5]))
    found = table.lookup([2], tokens, 1, 5, 2)
    for j, entry in enumerate(found, 1):
        assert entry is not None
        assert entry[0] == lps[j - 1, tokens[j]].item()
        assert [v for _, v in entry[1]] == lps[j - 1].topk(2).values.tolist()
    best = int(lps[3].argmax())
    other = next(t for t in range(VOCAB) if t not in lps[3].topk(TOP_K).indices.tolist())
    # another token after the page: from the top-k if it is there, else unknown
    got = table.lookup([2], [1, 2, 3, 4, best], 4, 5, 0)[0]
    assert got is not None and got[0] == lps[3, best].item()
    assert table.lookup([2], [1, 2, 3, 4, other], 4, 5, 0) == [None]
    assert table.lookup([3], tokens, 1, 3, 0) == [None, None]  # page 3 holds nothing
    table.forget(torch.tensor([2 * PS + 1]))  # its KV was rewritten without logits
    assert table.lookup([2], tokens, 1, 4, 0)[1] is None


def test_known_prefix_shortens_to_what_is_stored() -> None:
    table, lps = _table()
    tokens = list(range(1, 14))
    for page in range(3):  # pages 0..2 hold positions 0..11; page 1 without scores
        if page != 1:
            nexts = torch.tensor(tokens[page * PS + 1 :][:PS])
            table.store(torch.arange(page * PS, (page + 1) * PS), lps, nexts)
    assert table.known_prefix([0, 1, 2], tokens, 12, 1, 0) == 4  # position 5 unknown: compute from page 1
    assert table.known_prefix([0, 1, 2], tokens, 12, 9, 0) == 12  # needed only from 9 on: all stored
    assert table.known_prefix([0, 1, 2], tokens, 12, 9, TOP_K + 1) == 8  # more alternatives than kept
    assert table.known_prefix([0, 1, 2], tokens, 4, 7, 0) == 4  # every needed position is computed


def test_a_whole_row_serves_any_token_after_a_prompt_end() -> None:
    table, lps = _table()
    table.store(torch.arange(0, PS), lps, torch.tensor([2, 3, 4, -1]))  # the prompt ended at position 3
    other = next(t for t in range(VOCAB) if t not in lps[3].topk(TOP_K).indices.tolist())
    got = table.lookup([0], [1, 2, 3, 4, other], 4, 5, 1)[0]
    assert got is not None and got[0] == lps[3, other].item()
    assert table.next_lp[0, 3].isnan() and table.next_id[0, 3] == -1
    table.forget(torch.tensor([3]))
    assert table.lookup([0], [1, 2, 3, 4, other], 4, 5, 0) == [None]
    for page in range(MAX_ROWS + 1):  # only the latest rows are kept
        table.store(torch.tensor([page % 8 * PS]), lps[:1], torch.tensor([-1]))
    assert len(table.rows) <= MAX_ROWS


def test_records_round_trip_and_merge_keeps_what_either_knows() -> None:
    table, lps = _table()
    table.store(torch.arange(0, PS), lps, torch.tensor([2, 3, 4, 5]))
    records = table.read_pages(torch.tensor([0]))
    assert records.shape == (1, ScoreTable.record_bytes(PS)) and records.dtype == torch.uint8
    other = ScoreTable(8, PS)
    other.write_pages(torch.tensor([5]), records)
    assert torch.equal(other.next_lp[5], table.next_lp[0]) and torch.equal(other.top_ids[5], table.top_ids[0])
    other.merge([5], [6])
    assert torch.equal(other.next_lp[6], table.next_lp[0])
    other.forget(torch.tensor([5 * PS]))
    other.merge([5], [6])  # what page 6 knows is kept
    assert not math.isnan(other.next_lp[6, 0].item())
