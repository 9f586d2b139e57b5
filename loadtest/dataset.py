"""Prompts for load tests: a reproducible synthetic set, or ShareGPT-style conversations.

The synthetic set has a realistic spread: prompt lengths and output lengths are log-normal (many
short, a long tail), clipped to limits the caller sets to fit the server's
max_prefill_predict_length and max_target_length.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

# Common English words: enough variety for a tokenizer to produce ordinary token counts.
WORDS = (  # noqa: SIM905 - a paragraph reads better than 170 quoted words
    "the of and to in is was for on that with as by at from his her it an be this are which or had "
    "not but they have one you were all their there been has when who more will would no if out so "
    "said what up its about than into them can only other new some could time these two may then do "
    "first any my now such like our over man me even most made after also did many before must "
    "through back years where much your way well down should because each just those people how too "
    "little state good very make world still own see men work long get here between both life being "
    "under never day same another know while last might us great old year off come since against go "
    "came right used take three house river garden light ship harbour winter morning story history "
    "music letter window mountain village market teacher question answer reason summer evening road"
).split()

TASKS = (
    "Summarize the following text in a few sentences:",
    "Continue this story:",
    "Explain what this passage is about:",
    "Write a short reply to this message:",
    "List the main ideas in the following notes:",
)


@dataclass(frozen=True)
class Prompt:
    text: str
    max_tokens: int


def synthetic(
    n: int,
    seed: int = 0,
    prompt_words: tuple[int, int] = (40, 400),
    output_tokens: tuple[int, int] = (96, 512),
) -> list[Prompt]:
    """`n` prompts; (median, max) prompt words and (median, max) output tokens, log-normal spread."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = _lognormal(rng, *prompt_words, low=2)
        tokens = _lognormal(rng, *output_tokens, low=4)
        body = " ".join(rng.choice(WORDS) for _ in range(words))
        out.append(Prompt(f"{rng.choice(TASKS)} {body}", tokens))
    return out


def sharegpt(
    path: Path, n: int, seed: int = 0, max_prompt_chars: int = 4000, max_tokens: int = 512
) -> list[Prompt]:
    """First human turn of ShareGPT conversations ({"conversations": [{"from", "value"}, ...]});
    the output budget is the reply's length in words x 1.3 (about tokens), clipped."""
    data = json.loads(Path(path).read_text())
    rng = random.Random(seed)
    rng.shuffle(data)
    out = []
    for item in data:
        turns = item.get("conversations") or item.get("conversation") or []
        if len(turns) < 2 or not str(turns[0].get("value", "")).strip():
            continue
        prompt = str(turns[0]["value"])[:max_prompt_chars]
        reply_words = len(str(turns[1].get("value", "")).split())
        out.append(Prompt(prompt, max(4, min(max_tokens, int(reply_words * 1.3)))))
        if len(out) == n:
            break
    if not out:
        raise ValueError(f"{path}: no usable conversations (expected ShareGPT's conversations/from/value)")
    return out


def load(
    dataset: str | None,
    n: int,
    seed: int = 0,
    max_prompt_words: int = 400,
    max_output_tokens: int = 512,
) -> list[Prompt]:
    """`dataset` is a ShareGPT JSON file, or None for the synthetic set."""
    if dataset:
        return sharegpt(Path(dataset), n, seed, max_tokens=max_output_tokens)
    return synthetic(
        n,
        seed,
        prompt_words=(max(2, max_prompt_words // 10), max_prompt_words),
        output_tokens=(max(4, max_output_tokens // 5), max_output_tokens),
    )


def _lognormal(rng: random.Random, median: int, maximum: int, low: int) -> int:
    return int(min(maximum, max(low, round(rng.lognormvariate(math.log(max(median, 1)), 0.6)))))
