"""The fenced code blocks of README.md and docs/*.md, and the shell commands in them, with where
each one starts (file and line): for tests/test_docs_commands.py."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHELL = ("bash", "sh", "shell", "console")
FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)")


@dataclass(frozen=True)
class Block:
    path: Path  # relative to the repository
    line: int  # of the block's first line of code, 1-based
    language: str
    text: str


@dataclass(frozen=True)
class Command:
    path: Path
    line: int
    text: str  # continuation lines joined with single spaces, comment removed

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def doc_files(root: Path = REPO) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def blocks(path: Path, root: Path = REPO) -> list[Block]:
    """Every fenced block of one Markdown file, with its info string's first word as language."""
    found, lines = [], path.read_text().splitlines()
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        fence, language, start = match.group(2), match.group(3).lower(), i + 1
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            i += 1
        found.append(Block(path.relative_to(root), start + 1, language, "\n".join(lines[start:i])))
        i += 1
    return found


def commands(block: Block) -> list[Command]:
    """The commands of a shell block: one per line, backslash continuations joined, `# comments`
    and blank lines dropped; a `$ ` prompt (console blocks) is removed."""
    out: list[Command] = []
    pending, first = "", 0
    for offset, raw in enumerate(block.text.splitlines()):
        line = raw.rstrip()
        if not pending:
            first = block.line + offset
            line = line.lstrip()
            if line.startswith("$ "):
                line = line[2:]
        line = strip_comment(line)
        if line.endswith("\\"):
            pending += line[:-1].strip() + " "
            continue
        text = (pending + line.strip()).strip()
        pending = ""
        if text:
            out.append(Command(block.path, first, text))
    return out


def strip_comment(line: str) -> str:
    """`line` without a trailing `# comment` (a `#` outside quotes, after a space or at the start)."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line


def shell_commands(root: Path = REPO) -> list[Command]:
    return [
        c for path in doc_files(root) for b in blocks(path, root) if b.language in SHELL for c in commands(b)
    ]


def code_blocks(language: str, root: Path = REPO) -> list[Block]:
    return [b for path in doc_files(root) for b in blocks(path, root) if b.language == language]
