"""The demo's agent-style workload: multi-turn conversations over held-out stdlib source.

Every conversation shares one system preamble, then pastes a held-out module (never trained on):
a long first piece (``context_bytes``, the file an agent has just read), then a short piece per
later turn (``snippet_bytes``, the next lines). Turn ``t`` sends the whole conversation so far
(preamble, earlier user text, the model's earlier answers) plus the next piece of the file, cut at
line ends. Prompts therefore grow turn by turn and each one extends the previous prompt + answer,
which is exactly the prefix a KV cache can reuse; with short answers the reused prefix dominates
every turn after the first.

The transcript is built from the answers of one run (the *reference* run) and replayed as-is by
the others, so every backend sees byte-identical prompts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

from .. import tokenizer as tok
from ..assets.corpus import corpus_files, stdlib_root

PREAMBLE = '"""Agent session: each turn pastes more of a module; continue the code."""\n'


@dataclass(slots=True)
class Conversation:
    """One conversation: its source file, the user snippets per turn, the transcript so far."""

    name: str
    snippets: list[list[int]]        # user text (byte tokens) of each turn
    transcript: list[int] = field(default_factory=list)
    turn: int = 0                    # turns answered so far

    def prompt(self) -> list[int]:
        """The next turn's prompt: the transcript so far + a turn marker + the next snippet."""
        marker = tok.encode(f"\n# turn {self.turn + 1}\n")
        return self.transcript + marker + self.snippets[self.turn]

    def answer(self, prompt: list[int], token_ids: list[int]) -> None:
        """Record the model's answer to ``prompt`` (stop tokens dropped)."""
        self.transcript = list(prompt) + [t for t in token_ids if t < tok.NUM_BYTES]
        self.turn += 1


def _snippets(data: bytes, start: int, sizes: list[int]) -> list[list[int]]:
    """Consecutive snippets of about ``sizes[i]`` bytes from ``start``, each ending at a line end
    when a line end falls in its second half (else cut at the size)."""
    out, pos = [], start
    for size in sizes:
        chunk = data[pos:pos + size]
        cut = chunk.rfind(b"\n", size // 2) + 1
        chunk = chunk[:cut] if cut > 0 else chunk
        if not chunk:                  # end of file: start over (short modules, many turns)
            pos, chunk = 0, data[:size]
        out.append(list(chunk))
        pos += len(chunk)
    return out


def build_conversations(num: int, turns: int, snippet_bytes: int, seed: int = 0,
                        root: str | Path | None = None,
                        context_bytes: int = 0) -> list[Conversation]:
    """``num`` conversations of ``turns`` turns over distinct held-out modules (cycled when
    ``num`` exceeds their count); the start line in each file is drawn from ``seed``. The first
    turn pastes ``context_bytes`` of the module (``snippet_bytes`` when 0), later turns
    ``snippet_bytes`` each."""
    if num < 1 or turns < 1 or snippet_bytes < 16 or context_bytes < 0:
        raise ValueError(f"need conversations >= 1, turns >= 1, snippet_bytes >= 16 and "
                         f"context_bytes >= 0, got {num}, {turns}, {snippet_bytes}, "
                         f"{context_bytes}")
    files = corpus_files("heldout", root)
    base = Path(root) if root is not None else stdlib_root()
    rng = random.Random(seed)
    order = rng.sample(files, len(files))
    head = [tok.BOS] + tok.encode(PREAMBLE)
    sizes = [context_bytes or snippet_bytes] + [snippet_bytes] * (turns - 1)
    convs = []
    for c in range(num):
        f = order[c % len(order)]
        data = f.read_bytes()
        need = sum(sizes)
        lines = [0] + [i + 1 for i in range(max(0, len(data) - need)) if data[i] == 10]
        start = lines[rng.randrange(len(lines))]
        name = f.relative_to(base).as_posix()
        convs.append(Conversation(name, _snippets(data, start, sizes),
                                  head + tok.encode(f"# file: Lib/{name}\n")))
    return convs


def max_prompt_tokens(convs: list[Conversation], max_tokens: int) -> int:
    """An upper bound on any prompt of these conversations when answers have ``max_tokens``."""
    marker = len(tok.encode("\n# turn 999\n"))
    return max(len(c.transcript) + sum(len(s) + marker for s in c.snippets)
               + (len(c.snippets) - 1) * max_tokens for c in convs)
