"""Incremental detokenization and stop conditions, on a byte-level BPE that splits characters."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizer_util import CORPUS, make_tokenizer

from radixserve.sampling.detokenizer import IncrementalDetokenizer, TextStream, _decoder
from radixserve.sampling.params import SamplingParams
from radixserve.sampling.stop import token_stop

tokenizer = make_tokenizer()
EOS = tokenizer.eos_token_id
PROMPT = tokenizer.encode("naïve prompt 🙂")

MULTI_BYTE_TEXTS = [
    "héllo 你好 🙂",
    "naïve café 東京 🚀🙂 日本語のテキスト",
    "Ünïcödé ✓ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 👩‍👩‍👧 end",
    "🙂🙂🙂",
]


def encode(text: str) -> list[int]:
    return tokenizer.encode(text)


def decode(token_ids: list[int]) -> str:
    text = tokenizer.decode(token_ids)
    assert isinstance(text, str)
    return text


Step = tuple[str, str | None, str | int | None]  # what TextStream.append returns


class Sample(TextStream):
    """A TextStream fed as the engine feeds it: each token with its token-level stop (token_stop)."""

    def __init__(self, params: SamplingParams) -> None:
        super().__init__(tokenizer, params, PROMPT)
        self.params = params

    def append(self, token_id: int, stop: Any = None) -> Step:
        return super().append(token_id, token_stop(self.params, {EOS}, token_id, self.num_tokens + 1))


def stream(text: str, eos: bool = True, **params: Any) -> tuple[TextStream, list[Step]]:
    """Feed ``text``'s tokens (then EOS) until the stream finishes; return it and every step's result."""
    params.setdefault("max_tokens", 1000)
    text_stream = Sample(SamplingParams(**params))
    steps: list[Step] = []
    for token in encode(text) + ([EOS] if eos else []):
        steps.append(text_stream.append(token))
        if text_stream.finished:
            break
    return text_stream, steps


def joined(steps: list[Step]) -> str:
    return "".join(delta for delta, _, _ in steps)


def test_tokenizer_splits_multi_byte_characters() -> None:
    # Guards the tests below: they only mean something if some token ends mid-character.
    assert any("\ufffd" in decode([t]) for t in encode("🙂"))


@pytest.mark.parametrize("text", MULTI_BYTE_TEXTS)
def test_deltas_join_to_full_decode_without_broken_characters(text: str) -> None:
    detokenizer = IncrementalDetokenizer(tokenizer, PROMPT)
    deltas = [detokenizer.add(token) for token in encode(text)]
    assert all("\ufffd" not in delta for delta in deltas)
    assert "".join(deltas) == text
    assert detokenizer.flush() == ""


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\ufffd"), max_size=40))
def test_any_text_streams_back_exactly(text: str) -> None:
    text_stream, steps = stream(text)
    assert all("\ufffd" not in delta for delta, _, _ in steps)
    assert joined(steps) == text_stream.text == decode(encode(text))
    assert steps[-1][1:] == ("stop", None)


def test_flush_releases_a_character_cut_by_the_end() -> None:
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    first, second = encode("🙂")[:2]
    assert detokenizer.add(first) == ""
    assert detokenizer.flush() == decode([first])


def test_skipped_special_tokens_add_no_text() -> None:
    detokenizer = IncrementalDetokenizer(tokenizer, PROMPT)
    deltas = [detokenizer.add(t) for t in encode("hé") + [EOS] + encode("llo")]
    assert "".join(deltas) == "héllo"
    kept = IncrementalDetokenizer(tokenizer, PROMPT, skip_special_tokens=False)
    assert "".join(kept.add(t) for t in encode("hé") + [EOS]) == "hé<|endoftext|>"


def assert_never_leaks(steps: list[Step], final: str) -> None:
    emitted = ""
    for delta, _, _ in steps:
        emitted += delta
        assert final.startswith(emitted)
    assert emitted == final


def test_stop_string_across_token_boundary_is_cut() -> None:
    text = "The quick brown fox STOP here"
    assert "STOP" not in [decode([t]) for t in encode(text)]  # split across tokens
    text_stream, steps = stream(text, stop=["STOP"])
    assert steps[-1][1:] == ("stop", "STOP")
    assert text_stream.text == "The quick brown fox "
    assert_never_leaks(steps, "The quick brown fox ")
    assert len(steps) < len(encode(text))  # stopped before the rest was fed


def test_stop_string_inside_multi_byte_characters() -> None:
    text_stream, steps = stream("héllo 你好 🙂 world", stop=["好 🙂"])
    assert text_stream.text == "héllo 你"
    assert steps[-1][1:] == ("stop", "好 🙂")
    assert_never_leaks(steps, "héllo 你")


def test_stop_string_inside_one_token_and_earliest_wins() -> None:
    text_stream, steps = stream("héllo world", stop=["world", "ll"])
    assert text_stream.text == "hé"
    assert steps[-1][1:] == ("stop", "ll")
    assert_never_leaks(steps, "hé")


def test_false_start_of_a_stop_string_is_released() -> None:
    text = "The quick brown fox STOP here"
    text_stream, steps = stream(text, stop=["STOPPED"])
    held = [delta for delta, _, _ in steps]
    # While "ST" / "STOP" could still grow into "STOPPED" it is held back, then released.
    emitted_before_space = "".join(held[: len(encode("The quick brown fox STOP"))])
    assert not emitted_before_space.endswith("ST") and not emitted_before_space.endswith("STOP")
    assert joined(steps) == text_stream.text == text
    assert steps[-1][1:] == ("stop", None)


def test_eos_stops_and_adds_no_text() -> None:
    text_stream, steps = stream("hello", skip_special_tokens=False)
    assert steps[-1] == ("", "stop", None)
    assert text_stream.text == "hello" and text_stream.num_tokens == len(encode("hello")) + 1


def test_ignore_eos_keeps_going_until_length() -> None:
    text_stream = Sample(SamplingParams(ignore_eos=True, max_tokens=3))
    assert text_stream.append(EOS)[1] is None
    assert text_stream.append(encode("hi")[0])[1] is None
    assert text_stream.append(EOS)[1:] == ("length", None)
    assert text_stream.text == "h"


def test_stop_token_id_stops_with_its_id_and_adds_no_text() -> None:
    tokens = encode("quick fox jumps")
    stop_id = tokens[2]
    assert stop_id not in tokens[:2]
    text_stream, steps = stream("quick fox jumps", stop_token_ids=[stop_id])
    assert len(steps) == 3 and steps[-1][1:] == ("stop", stop_id)
    assert joined(steps) == text_stream.text == decode(tokens[:2])


def test_max_tokens_finishes_with_length_and_flushes_held_text() -> None:
    tokens = encode("The quick brown fox ST")
    text_stream, steps = stream("The quick brown fox ST", eos=False, stop=["STOP"], max_tokens=len(tokens))
    assert steps[-1][1:] == ("length", None)
    assert all(reason is None for _, reason, _ in steps[:-1])
    assert joined(steps) == text_stream.text == "The quick brown fox ST"


def test_max_tokens_cutting_a_character_returns_its_bytes_as_replacement() -> None:
    tokens = encode("ok 🙂")
    cut = next(i for i in range(1, len(tokens)) if decode(tokens[:i]).endswith("\ufffd"))
    text_stream, steps = stream("ok 🙂", eos=False, max_tokens=cut)
    assert steps[-1][1] == "length"
    assert joined(steps) == text_stream.text == decode(tokens[:cut])


def test_append_after_finish_raises() -> None:
    text_stream, _ = stream("hi")
    with pytest.raises(RuntimeError):
        text_stream.append(EOS)


def test_eos_releases_a_held_back_stop_prefix() -> None:
    text_stream, steps = stream("The quick brown fox ST", stop=["STOP"])
    assert joined(steps[:-1]) == "The quick brown fox "  # "ST" waits: it may become "STOP"
    assert steps[-1] == ("ST", "stop", None)
    assert joined(steps) == text_stream.text == "The quick brown fox ST"


def test_include_stop_str_in_output_keeps_the_stop_string() -> None:
    kept, steps = stream("The quick brown fox STOP here", stop=["STOP"], include_stop_str_in_output=True)
    assert joined(steps) == kept.text == "The quick brown fox STOP"
    assert (kept.finish_reason, kept.stop_reason) == ("stop", "STOP")
    cut, _ = stream("The quick brown fox STOP here", stop=["STOP"])
    assert cut.text == "The quick brown fox "


def test_stop_strings_do_not_count_before_min_tokens() -> None:
    early, _ = stream("STOP here, then STOP again", stop=["STOP"], min_tokens=3)
    assert early.text == "STOP here, then "  # the first STOP ended within the first 3 tokens
    assert stream("STOP here", stop=["STOP"])[0].text == ""


def test_the_backend_decode_is_taken_only_where_it_is_the_same_text() -> None:
    tok = make_tokenizer()
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert isinstance(end, int)
    ids = encode(" ".join(CORPUS)) + [end]
    # Every window the detokenizer decodes, with and without special tokens: the same text as HF's decode.
    decode = _decoder(tok)
    assert decode is not tok.decode and tok.clean_up_tokenization_spaces is False
    for skip in (True, False):
        for start in range(0, len(ids), 3):
            window = ids[start : start + 7]
            assert decode(window, skip_special_tokens=skip) == tok.decode(window, skip_special_tokens=skip)
    # A tokenizer that cleans up spaces keeps HF's decode (its text differs from the backend's).
    cleaning = copy.copy(tok)
    cleaning.clean_up_tokenization_spaces = True
    assert _decoder(cleaning) == cleaning.decode
