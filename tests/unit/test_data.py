"""Tests of the character corpus and of autoregressive text sampling."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from elasticpipe.demo.corpus import CharCorpus, _python_sources, sample_text
from elasticpipe.errors import InvalidRequest
from elasticpipe.models.contract import build

PRINTABLE = "".join(chr(code) for code in range(32, 127)) + "\n"
TEXT = "def f(x):\n    return x + 1\n" * 20


@pytest.fixture(scope="module")
def stdlib_corpus() -> CharCorpus:
    """A small corpus read from the standard library."""
    return CharCorpus.from_stdlib(max_bytes=100_000)


def test_vocabulary_is_printable_ascii_and_newline() -> None:
    """The alphabet has 96 symbols: newline and the 95 printable ASCII characters."""
    corpus = CharCorpus(TEXT)
    assert corpus.vocab_size == 96
    assert corpus.decode(range(96)) == "\n" + PRINTABLE[:-1]


@given(st.text(alphabet=PRINTABLE))
def test_encode_decode_round_trip(text: str) -> None:
    """Text over the alphabet survives encode then decode unchanged, as int64 ids."""
    corpus = CharCorpus(TEXT)
    ids = corpus.encode(text)
    assert ids.dtype == torch.int64
    assert ids.shape == (len(text),)
    assert corpus.decode(ids) == text
    assert corpus.decode(ids.tolist()) == text


def test_normalizes_tabs_line_ends_and_foreign_characters() -> None:
    """Tabs become four spaces, CR/CRLF become newlines, other characters become '?'."""
    corpus = CharCorpus("a\tb\r\nc\rd é€\x00")
    assert corpus.text == "a    b\nc\nd ???"
    assert len(corpus) == len(corpus.text)
    assert corpus.decode(corpus.encode("\tü")) == "    ?"


@pytest.mark.parametrize("ids", [[96], [-1], [1.5], torch.zeros(2, 2, dtype=torch.int64)])
def test_decode_rejects_invalid_ids(ids: Any) -> None:
    """Ids out of range, non-integers or a 2-D tensor are an InvalidRequest."""
    with pytest.raises(InvalidRequest):
        CharCorpus(TEXT).decode(ids)


def test_batch_windows_are_shifted_slices_of_the_text() -> None:
    """Each input row is a window of the text and its target is the same window shifted by one."""
    corpus = CharCorpus(TEXT)
    inputs, targets = corpus.batch(8, 16, torch.Generator().manual_seed(0))
    assert inputs.shape == targets.shape == (8, 16)
    assert inputs.dtype == targets.dtype == torch.int64
    for row, target in zip(inputs, targets, strict=True):
        window = corpus.decode(row) + corpus.decode(target[-1:])
        assert window in corpus.text
        assert torch.equal(row[1:], target[:-1])


def test_batch_is_determined_by_the_generator() -> None:
    """The same generator seed draws the same batch; another seed draws another."""
    corpus = CharCorpus(TEXT)
    a = corpus.batch(4, 8, torch.Generator().manual_seed(1))
    b = corpus.batch(4, 8, torch.Generator().manual_seed(1))
    c = corpus.batch(4, 8, torch.Generator().manual_seed(2))
    assert torch.equal(a[0], b[0])
    assert torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


def test_batch_can_use_the_whole_corpus() -> None:
    """A window of length len - 1 fits exactly; one of length len does not."""
    corpus = CharCorpus("abcd")
    inputs, targets = corpus.batch(2, 3, torch.Generator())
    assert corpus.decode(inputs[0]) == "abc"
    assert corpus.decode(targets[0]) == "bcd"
    with pytest.raises(InvalidRequest, match="seq_len 4"):
        corpus.batch(1, 4, torch.Generator())


@pytest.mark.parametrize(
    ("batch_size", "seq_len", "message"),
    [(0, 4, "batch_size .* got 0"), (2, 0, "seq_len .* got 0"), (2, 1000, "seq_len 1000")],
)
def test_batch_rejects_invalid_sizes(batch_size: int, seq_len: int, message: str) -> None:
    """A batch size or window length that cannot be served is an InvalidRequest naming it."""
    with pytest.raises(InvalidRequest, match=message):
        CharCorpus(TEXT).batch(batch_size, seq_len, torch.Generator())


def test_from_stdlib_is_deterministic_and_bounded(stdlib_corpus: CharCorpus) -> None:
    """Reading the standard library twice gives the same text, capped at max_bytes."""
    assert len(stdlib_corpus) == 100_000
    assert CharCorpus.from_stdlib(max_bytes=100_000).text == stdlib_corpus.text
    assert set(stdlib_corpus.text) <= set(PRINTABLE)
    assert "def " in stdlib_corpus.text


def test_from_stdlib_rejects_nonpositive_size() -> None:
    """max_bytes below one is an InvalidRequest naming it."""
    with pytest.raises(InvalidRequest, match="got 0"):
        CharCorpus.from_stdlib(max_bytes=0)


def test_python_sources_skip_tests_and_packages(tmp_path: Path) -> None:
    """Source listing is sorted and leaves out test dirs, test_ files and site-packages."""
    for name in [
        "b.py",
        "a.py",
        "notes.txt",
        "pkg/z.py",
        "pkg/test_z.py",
        "pkg/tests/t.py",
        "test/t.py",
        "idlelib/idle_test/t.py",
        "site-packages/dep.py",
    ]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x = 1\n")
    found = [path.relative_to(tmp_path).as_posix() for path in _python_sources(tmp_path)]
    assert found == ["a.py", "b.py", "pkg/z.py"]


def test_sample_text_is_seeded_and_crops_the_context() -> None:
    """Sampling is reproducible from its seed and never passes more than max_seq_len ids."""
    corpus = CharCorpus(TEXT)
    lengths: list[int] = []

    def logits_fn(ids: torch.Tensor) -> torch.Tensor:
        lengths.append(ids.shape[1])
        assert ids.dtype == torch.int64
        return torch.zeros(1, ids.shape[1], corpus.vocab_size)

    first = sample_text(logits_fn, corpus, "ab", 20, max_seq_len=8, seed=3)
    assert first.startswith("ab")
    assert len(first) == 22
    assert sample_text(logits_fn, corpus, "ab", 20, max_seq_len=8, seed=3) == first
    assert sample_text(logits_fn, corpus, "ab", 20, max_seq_len=8, seed=4) != first
    assert max(lengths) == 8
    assert lengths[:7] == [2, 3, 4, 5, 6, 7, 8]


def test_sample_text_at_zero_temperature_is_greedy() -> None:
    """Temperature 0 always picks the highest logit."""
    corpus = CharCorpus(TEXT)
    favourite = int(corpus.encode("z")[0])

    def logits_fn(ids: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(1, ids.shape[1], corpus.vocab_size)
        logits[..., favourite] = 1.0
        return logits

    assert sample_text(logits_fn, corpus, "", 5, 4, temperature=0.0) == "zzzzz"


def test_sample_text_runs_the_gpt_builtin() -> None:
    """The built-in gpt can drive sampling end to end."""
    corpus = CharCorpus(TEXT)
    model = build("gpt", seed=0, n_layers=1, max_seq_len=16)
    text = sample_text(model, corpus, "def ", 24, max_seq_len=16)
    assert text.startswith("def ")
    assert len(text) == 28


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"length": -1}, "length"),
        ({"max_seq_len": 0}, "max_seq_len"),
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
    ],
)
def test_sample_text_rejects_invalid_arguments(kwargs: dict[str, Any], message: str) -> None:
    """Negative lengths, empty contexts and negative temperatures are an InvalidRequest."""
    corpus = CharCorpus(TEXT)
    arguments: dict[str, Any] = {"length": 3, "max_seq_len": 4, **kwargs}

    def logits_fn(ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros(1, ids.shape[1], corpus.vocab_size)

    with pytest.raises(InvalidRequest, match=message):
        sample_text(logits_fn, corpus, "a", **arguments)


def test_sample_text_rejects_logits_of_the_wrong_shape() -> None:
    """A logits_fn that returns the wrong shape is an InvalidRequest naming both shapes."""
    corpus = CharCorpus(TEXT)
    with pytest.raises(InvalidRequest, match=r"\(1, 95\).*\(1, 1, 96\)"):
        sample_text(lambda ids: torch.zeros(1, 95), corpus, "a", 1, 4)
