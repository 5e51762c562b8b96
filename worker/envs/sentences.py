"""Made-up sentences for procedural text tasks and for training the tiny tokenizer.

Words are random consonant-vowel syllables, so no sentence can be memorised from a corpus and the
character distribution is the same for every split.
"""

from __future__ import annotations

import random

_CONSONANTS = "bcdfghjklmnprstvwz"
_VOWELS = "aeiou"


def make_word(rng: random.Random) -> str:
    """One word of 1-3 consonant-vowel syllables, e.g. ``"tovi"``."""
    return "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(rng.randint(1, 3)))


def make_sentence(rng: random.Random, min_chars: int = 5, max_chars: int = 30) -> str:
    """A sentence of made-up words whose length lies in ``[min_chars, max_chars]`` characters.

    Raises:
        ValueError: if ``min_chars`` < 2 or ``max_chars`` < ``min_chars``.
    """
    if min_chars < 2 or max_chars < min_chars:
        raise ValueError(f"min_chars/max_chars: expected 2 <= min_chars <= max_chars, got {min_chars}, {max_chars}")
    target = rng.randint(min_chars, max_chars)
    words: list[str] = []
    while len(" ".join(words)) < target:
        words.append(make_word(rng))
    text = " ".join(words)[:target].rstrip()
    if len(text) < min_chars:  # a trailing space was stripped: pad with a letter
        text += rng.choice(_VOWELS)
    return text[0].upper() + text[1:] + "."
