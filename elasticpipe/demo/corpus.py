"""An offline character-level corpus (the standard library's own source) and text sampling."""

from __future__ import annotations

import os
import re
import sysconfig
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from elasticpipe.errors import InvalidRequest

__all__ = ["CharCorpus", "sample_text"]

# Id 0 is "\n", ids 1..95 are the printable ASCII characters " " (32) to "~" (126).
_ALPHABET = "\n" + "".join(chr(code) for code in range(32, 127))
_UNKNOWN = "?"
_OUTSIDE_ALPHABET = re.compile(r"[^\n\x20-\x7e]")
_CODE_TO_ID = torch.full((128,), _ALPHABET.index(_UNKNOWN), dtype=torch.uint8)
for _id, _char in enumerate(_ALPHABET):
    _CODE_TO_ID[ord(_char)] = _id
del _id, _char

# Directories of the standard library that hold tests or third-party code, not its source.
_SKIPPED_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
)


def _normalize(text: str) -> str:
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\t", "    ")
    return _OUTSIDE_ALPHABET.sub(_UNKNOWN, text)


def _python_sources(root: Path) -> list[Path]:
    """Lists the ``.py`` files under ``root`` outside test and package dirs, sorted."""
    found: list[Path] = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in _SKIPPED_DIRS]
        found.extend(
            Path(directory, name)
            for name in files
            if name.endswith(".py") and not name.startswith("test_")
        )
    return sorted(found, key=lambda path: path.relative_to(root).as_posix())


def _read_sources(root: Path, max_bytes: int) -> str:
    parts: list[str] = []
    total = 0
    for path in _python_sources(root):
        text = _normalize(path.read_text(encoding="utf-8", errors="replace"))
        parts.append(text[: max_bytes - total])
        total += len(parts[-1])
        if total >= max_bytes:
            break
    return "".join(parts)


class CharCorpus:
    """A text over a fixed 96-symbol alphabet, and random training windows over it.

    The alphabet is ``"\\n"`` and the 95 printable ASCII characters; tabs become four
    spaces, ``"\\r\\n"`` and ``"\\r"`` become ``"\\n"``, anything else becomes ``"?"``.
    """

    vocab_size: int = len(_ALPHABET)

    def __init__(self, text: str) -> None:
        """Normalizes and encodes a text.

        Args:
            text: Any text; characters outside the alphabet are replaced.
        """
        self.text = _normalize(text)
        self._ids = self._lookup(self.text)

    @classmethod
    def from_stdlib(cls, max_bytes: int = 2_000_000) -> CharCorpus:
        """Reads the standard library's ``.py`` files, in sorted path order, up to a size.

        Test directories, ``test_*.py`` files and site-packages are skipped; the result
        is the same on every call in the same Python installation.

        Args:
            max_bytes: The most characters to keep (one byte each once normalized).

        Returns:
            The corpus.

        Raises:
            InvalidRequest: ``max_bytes < 1``, or no source file was found.
        """
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise InvalidRequest(f"max_bytes must be an int >= 1, got {max_bytes!r}")
        root = Path(sysconfig.get_paths()["stdlib"])
        text = _read_sources(root, max_bytes)
        if not text:
            raise InvalidRequest(f"found no Python source under {str(root)!r}")
        return cls(text)

    @staticmethod
    def _lookup(normalized: str) -> torch.Tensor:
        if not normalized:  # frombuffer refuses an empty buffer
            return torch.empty(0, dtype=torch.uint8)
        codes = torch.frombuffer(bytearray(normalized.encode("ascii")), dtype=torch.uint8)
        return _CODE_TO_ID[codes.long()]

    def __len__(self) -> int:
        """Returns the number of characters."""
        return int(self._ids.numel())

    def encode(self, s: str) -> torch.Tensor:
        """Encodes a string, normalizing it as the corpus text was.

        Args:
            s: Any string.

        Returns:
            The 1-D int64 ids.
        """
        return self._lookup(_normalize(s)).long()

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        """Decodes ids back to text.

        Args:
            ids: A sequence or 1-D tensor of ids in ``[0, vocab_size)``.

        Returns:
            The text.

        Raises:
            InvalidRequest: ``ids`` is not one-dimensional or holds an id out of range.
        """
        if isinstance(ids, torch.Tensor):
            if ids.dim() > 1:
                raise InvalidRequest(f"ids must be 1-D, got shape {tuple(ids.shape)}")
            ids = ids.tolist()
        chars = []
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.vocab_size:
                raise InvalidRequest(f"id {i!r} is not in [0, {self.vocab_size})")
            chars.append(_ALPHABET[i])
        return "".join(chars)

    def batch(
        self, batch_size: int, seq_len: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draws random windows of the text for next-character prediction.

        Args:
            batch_size: Number of windows.
            seq_len: Length of each window.
            generator: A CPU generator; the same state gives the same batch.

        Returns:
            ``(inputs, targets)``, both int64 of shape (batch_size, seq_len), where
            ``targets[:, t]`` is the character after ``inputs[:, t]``.

        Raises:
            InvalidRequest: ``batch_size < 1``, ``seq_len < 1``, or the corpus is not longer
                than ``seq_len``.
        """
        for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidRequest(f"{name} must be an int >= 1, got {value!r}")
        if seq_len >= len(self):
            raise InvalidRequest(
                f"seq_len {seq_len} needs a corpus of at least {seq_len + 1} characters, "
                f"this one has {len(self)}"
            )
        starts = torch.randint(0, len(self) - seq_len, (batch_size,), generator=generator)
        windows = self._ids[starts[:, None] + torch.arange(seq_len + 1)].long()
        return windows[:, :-1], windows[:, 1:]


def sample_text(
    logits_fn: Callable[[torch.Tensor], torch.Tensor],
    corpus: CharCorpus,
    prompt: str,
    length: int,
    max_seq_len: int,
    temperature: float = 0.8,
    seed: int = 0,
) -> str:
    """Generates text one character at a time from a next-character model.

    Args:
        logits_fn: Maps int64 ids (1, t), t <= ``max_seq_len``, to logits (1, t, vocab).
        corpus: Gives the alphabet.
        prompt: Text to continue; when empty, generation starts after a ``"\\n"``.
        length: Number of characters to generate.
        max_seq_len: The longest context passed to ``logits_fn`` (the oldest is cropped).
        temperature: Softmax temperature; 0 picks the most likely character.
        seed: Seed of the sampling generator.

    Returns:
        ``prompt`` followed by the generated characters.

    Raises:
        InvalidRequest: An argument is out of range, or ``logits_fn`` returned logits of
            the wrong shape.
    """
    if isinstance(length, bool) or not isinstance(length, int) or length < 0:
        raise InvalidRequest(f"length must be an int >= 0, got {length!r}")
    if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 1:
        raise InvalidRequest(f"max_seq_len must be an int >= 1, got {max_seq_len!r}")
    if not temperature >= 0:  # also rejects NaN
        raise InvalidRequest(f"temperature must be >= 0, got {temperature!r}")
    context = corpus.encode(prompt).tolist() or corpus.encode("\n").tolist()
    generator = torch.Generator().manual_seed(seed)
    generated: list[int] = []
    with torch.no_grad():
        for _ in range(length):
            ids = torch.tensor([context[-max_seq_len:]], dtype=torch.int64)
            logits = logits_fn(ids)
            expected = (1, ids.shape[1], corpus.vocab_size)
            if tuple(logits.shape) != expected:
                raise InvalidRequest(
                    f"logits_fn returned shape {tuple(logits.shape)}, expected {expected}"
                )
            last = logits[0, -1].detach().float().cpu()
            if temperature == 0:
                choice = int(last.argmax())
            else:
                probs = torch.softmax(last / temperature, dim=0)
                choice = int(torch.multinomial(probs, 1, generator=generator))
            context.append(choice)
            generated.append(choice)
    return prompt + corpus.decode(generated)
