"""IncrementalDetokenizer on the default model's tokenizer (SmolLM2, byte-level BPE)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rivulet.engine.detokenizer import IncrementalDetokenizer
from rivulet.sampling_params import SamplingParams

EMOJI_CJK = "Hi 😀🎉 你好世界, naïve café 🧑‍🚀 ok"
FFFD = "\ufffd"


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def stream(detok: IncrementalDetokenizer, ids: list[int], chunks: list[int] | None = None) -> list[str]:
    """Feed ``ids`` in chunks (default one token at a time); return every delta, flush last."""
    deltas = []
    sizes = iter(chunks or [])
    i = 0
    while i < len(ids):
        size = max(1, next(sizes, 1))
        deltas.append(detok.update(ids[i : i + size]))
        i += size
    deltas.append(detok.flush())
    return deltas


def first_stop(text: str, stops: list[str]) -> tuple[int, int, str] | None:
    """(start, end, stop) of the stop string that completes first; ties: the longest."""
    for end in range(1, len(text) + 1):
        matches = [s for s in stops if text[:end].endswith(s)]
        if matches:
            stop = max(matches, key=len)
            return end - len(stop), end, stop
    return None


# ------------------------------------------------------------ plain decoding


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_streamed_deltas_join_to_full_decode(tokenizer, skip_special_tokens: bool) -> None:
    text = "<|im_start|>assistant\nSure! " + EMOJI_CJK + "<|im_end|>"
    ids = encode(tokenizer, text)
    assert 1 in ids and 2 in ids  # the special tokens really are tokens here
    prompt = encode(tokenizer, "<|im_start|>user\nHello 😀<|im_end|>\n")
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip_special_tokens)
    deltas = stream(detok, ids)
    expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert "".join(deltas) == expected == detok.output_text
    if skip_special_tokens:
        assert expected == "assistant\nSure! " + EMOJI_CJK
    else:
        assert expected == text
    assert detok.output_token_ids == ids
    assert not detok.finished and detok.stop_reason is None


def test_multi_token_characters_appear_only_when_complete(tokenizer) -> None:
    ids = encode(tokenizer, EMOJI_CJK)
    pieces = [tokenizer.backend_tokenizer.decode([i]) for i in ids]
    assert sum(FFFD in piece for piece in pieces) >= 6  # characters really are split
    detok = IncrementalDetokenizer(tokenizer, [])
    deltas = stream(detok, ids)
    assert all(FFFD not in delta for delta in deltas)
    assert "".join(deltas) == EMOJI_CJK
    # Some tokens complete nothing (they hold half a character), and the emoji comes whole.
    assert "" in deltas[:-1]
    assert any("😀" in delta for delta in deltas)
    assert sum(delta.count("你") for delta in deltas) == 1


def test_incomplete_trailing_character_is_released_by_flush(tokenizer) -> None:
    ids = encode(tokenizer, "ok 😀")
    truncated = ids[:-1]  # drop the emoji's last byte(s)
    detok = IncrementalDetokenizer(tokenizer, [])
    streamed = "".join(detok.update([i]) for i in truncated)
    assert streamed == "ok"
    tail = detok.flush()
    assert streamed + tail == tokenizer.decode(truncated)
    assert tail.endswith(FFFD)
    assert detok.flush() == "" and detok.update([ids[-1]]) == ""  # closed


def _token_ids(tokenizer):
    """Token ids biased towards byte fragments (half characters) and special tokens."""
    ids = encode(tokenizer, EMOJI_CJK + "ü€😀🎉你好")
    fragments = sorted({i for i in ids if FFFD in tokenizer.backend_tokenizer.decode([i])})
    return st.one_of(
        st.integers(0, len(tokenizer) - 1),
        st.sampled_from(fragments),
        st.integers(0, 16),  # special tokens
    )


@settings(max_examples=150, deadline=None)
@given(data=st.data(), skip_special_tokens=st.booleans())
def test_random_token_sequences_stream_to_full_decode(tokenizer, data, skip_special_tokens: bool) -> None:
    ids = data.draw(st.lists(_token_ids(tokenizer), max_size=40), label="ids")
    prompt = data.draw(st.lists(_token_ids(tokenizer), max_size=8), label="prompt")
    chunks = data.draw(st.lists(st.integers(1, 4), max_size=40), label="chunks")
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip_special_tokens)
    deltas = stream(detok, ids, chunks)
    expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert "".join(deltas) == expected == detok.output_text
    if FFFD not in expected:
        assert all(FFFD not in delta for delta in deltas)


# ------------------------------------------------------------- stop strings


@pytest.mark.parametrize(
    ("include", "expected"),
    [(False, "The answer is "), (True, "The answer is STOP_HERE")],
)
def test_stop_string_split_across_tokens(tokenizer, include: bool, expected: str) -> None:
    ids = encode(tokenizer, "The answer is STOP_HERE and more")
    pieces = [tokenizer.decode([i]) for i in ids]
    assert "STOP_HERE" not in pieces and pieces.count("OP") == 1  # spread over tokens
    detok = IncrementalDetokenizer(
        tokenizer, [], stop=["NEVER", "STOP_HERE"], include_stop_str_in_output=include
    )
    deltas = [detok.update([i]) for i in ids]
    assert detok.finished and detok.stop_reason == "STOP_HERE"
    assert detok.output_text == expected
    assert "".join(deltas) + detok.flush() == expected
    # Tokens after the stop were ignored.
    assert detok.output_token_ids == ids[: pieces.index("ERE") + 1]
    # Nothing of the stop string was shown before it was recognised.
    stop_step = pieces.index("ERE")
    assert "".join(deltas[:stop_step]) == "The answer is "[: len("".join(deltas[:stop_step]))]
    assert "S" not in "".join(deltas[:stop_step])


def test_stop_string_inside_one_token_and_after_multibyte(tokenizer) -> None:
    ids = encode(tokenizer, "你好世界 and so on")
    detok = IncrementalDetokenizer(tokenizer, [], stop=["好世"])
    assert "".join(stream(detok, ids)) == "你"
    assert detok.stop_reason == "好世" and detok.output_text == "你"


def test_holds_back_possible_stop_prefix_and_flush_releases_it(tokenizer) -> None:
    ids = encode(tokenizer, "hello world")
    detok = IncrementalDetokenizer(tokenizer, [], stop=["xyz", "worlds"])  # longest: 6 chars
    streamed = detok.update(ids)
    assert detok.output_text == "hello world"
    assert streamed == "hello "  # the last 5 characters might start "worlds"
    assert detok.flush() == "world"
    assert not detok.finished


def test_earliest_completed_stop_wins(tokenizer) -> None:
    ids = encode(tokenizer, "one two three four")
    detok = IncrementalDetokenizer(tokenizer, [], stop=["three", "two", "one two three"])
    assert "".join(stream(detok, ids)) == "one "
    assert detok.stop_reason == "two"
    # A single update with all tokens finds the same, earliest, stop.
    detok = IncrementalDetokenizer(tokenizer, [], stop=["four", "wo t"], include_stop_str_in_output=True)
    assert detok.update(ids) == "one two t"
    assert detok.stop_reason == "wo t"
    # Two stops completed by the same token: the one that ends first wins, whatever
    # the order of the list; at the same end, the one that starts first.
    ids = encode(tokenizer, "hello world")
    assert tokenizer.decode(ids[-1:]) == " world"
    for stops, reason, text in ((["ld", "wor"], "wor", "hello "), (["d", "rld", "orld"], "orld", "hello w")):
        detok = IncrementalDetokenizer(tokenizer, [], stop=stops)
        assert detok.update(ids) == text
        assert detok.stop_reason == reason


def test_min_tokens_delays_stop_strings(tokenizer) -> None:
    ids = encode(tokenizer, "stop here, then stop again")
    assert len(ids) > 4
    detok = IncrementalDetokenizer(tokenizer, [], stop=["stop"], min_tokens=3)
    assert "".join(stream(detok, ids)) == "stop here, then "
    assert detok.stop_reason == "stop"


def test_from_params(tokenizer) -> None:
    params = SamplingParams(stop="!", include_stop_str_in_output=True, skip_special_tokens=False)
    detok = IncrementalDetokenizer.from_params(tokenizer, [], params)
    ids = encode(tokenizer, "<|im_start|>Hi! there")
    assert "".join(stream(detok, ids)) == "<|im_start|>Hi!"
    assert detok.stop_reason == "!"


@settings(max_examples=120, deadline=None)
@given(
    text=st.text(alphabet="ab c😀\n", max_size=30),
    stops=st.lists(st.text(alphabet="ab c😀", min_size=1, max_size=4), min_size=1, max_size=3),
    include=st.booleans(),
    chunks=st.lists(st.integers(1, 3), max_size=30),
)
def test_stop_strings_property(tokenizer, text: str, stops: list[str], include: bool, chunks: list[int]) -> None:
    ids = encode(tokenizer, text)
    full = tokenizer.decode(ids)
    assert full == text
    match = first_stop(full, stops)
    detok = IncrementalDetokenizer(tokenizer, [], stop=stops, include_stop_str_in_output=include)
    emitted = ""
    sizes = iter(chunks)
    i = 0
    while i < len(ids) and not detok.finished:
        size = next(sizes, 1)
        emitted += detok.update(ids[i : i + size])
        i += size
        if not detok.finished:
            # Text that may still become part of a stop string is never shown.
            held = max(len(s) for s in stops) - 1
            assert len(emitted) == max(0, len(detok.output_text) - held)
            if match is not None:
                assert len(emitted) <= match[0]
    emitted += detok.flush()
    assert emitted == detok.output_text
    if match is None:
        assert emitted == full and detok.stop_reason is None
    else:
        start, end, stop = match
        assert detok.stop_reason == stop
        assert emitted == full[: end if include else start]
