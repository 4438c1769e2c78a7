"""A deterministic corpus and batches that depend only on (step, rank).

The corpus is generated from a small seeded grammar (no file to ship, no licence to track) and
tokenised per character. ``batch_for`` seeds its own generator from the step and rank, so any
process — a survivor, a hot spare, a fresh replacement or a reference run — draws the same batch
for the same position: the data position *is* the step, and a recovered rank needs nothing else.
"""

from __future__ import annotations

import functools
import random

import torch

CORPUS_SEED = 1234
CORPUS_SENTENCES = 3000
BATCH_SIZE = 4
BLOCK_SIZE = 64

_SUBJECTS = ["the rank", "a spare", "the engine", "every replica", "the agent", "a donor"]
_VERBS = ["sends", "keeps", "restores", "commits", "rebuilds", "watches", "replays"]
_OBJECTS = ["the state", "its step", "the group", "a new generation", "the log", "every record"]
_ENDINGS = [".", " again.", " at once.", " within one step.", " without a restart."]


@functools.cache
def corpus() -> str:
    rng = random.Random(CORPUS_SEED)
    sentences = (
        f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}{rng.choice(_ENDINGS)}"
        for _ in range(CORPUS_SENTENCES)
    )
    return " ".join(sentences)


@functools.cache
def vocabulary() -> str:
    return "".join(sorted(set(corpus())))


@functools.cache
def _tokens() -> torch.Tensor:
    index = {ch: i for i, ch in enumerate(vocabulary())}
    return torch.tensor([index[ch] for ch in corpus()], dtype=torch.long)


def batch_for(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-character targets ([BATCH_SIZE, BLOCK_SIZE]) of one rank at one step.

    ``world_size`` makes runs of different sizes draw different data; within one size, a batch
    is a pure function of (step, rank).
    """
    tokens = _tokens()
    rng = random.Random(f"{world_size}:{step}:{rank}")  # str seeds hash the same in every process
    starts = [rng.randrange(len(tokens) - BLOCK_SIZE - 1) for _ in range(BATCH_SIZE)]
    x = torch.stack([tokens[s : s + BLOCK_SIZE] for s in starts])
    y = torch.stack([tokens[s + 1 : s + BLOCK_SIZE + 1] for s in starts])
    return x, y
