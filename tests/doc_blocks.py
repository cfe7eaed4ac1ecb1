"""The fenced code blocks of README.md and docs/*.md, and what a user pasting one would run.

A block's language tag says what it is: ```python and ```sh are code a user pastes (checked by
tests/unit/test_doc_blocks.py; runnable python blocks also run, tests/distributed/test_doc_examples.py);
```text, ```json and ```toml are shown, not run (deliberately: a signature, a format with `...`);
a block without a tag is output (a transcript, a diagram, a table) and may not hold a command.
"""

from __future__ import annotations

import ast
import builtins
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CODE = ("python", "sh")
NOT_RUN = ("text", "json", "toml")

_FENCE = re.compile(r"^ {0,3}(`{3,})([^`\s]*)\s*$")
# a line of an untagged block that a user would paste: a command, not its output (`threefold: ...`, `$ ...`)
COMMAND_LINE = re.compile(r"^\s*(\w+=\S+\s+)*(threefold\s+(train|plan|ckpt|parity|schedule|data|runs)|torchrun|python3?|pip|bash"
                          r"|sbatch|srun|make)\s")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(paths=DOCUMENTS) -> list[Block]:
    found = []
    for path in paths:
        lines = path.read_text(encoding="utf-8").splitlines()
        i = 0
        while i < len(lines):
            opening = _FENCE.match(lines[i])
            if opening is None:
                i += 1
                continue
            fence, end = opening.group(1), i + 1
            while end < len(lines) and lines[end].strip() != fence:
                end += 1
            assert end < len(lines), f"{path.relative_to(ROOT)}:{i + 1}: a code block is never closed"
            found.append(Block(path, i + 1, opening.group(2), "\n".join(lines[i + 1:end]) + "\n"))
            i = end + 1
    return found


def commands(text: str) -> list[list[str]]:
    """The simple commands of a shell block: continuation lines joined, comments dropped, split at
    `;`, `&&`, `||` and `|`."""
    out = []
    for line in re.sub(r"\\\n", " ", text).splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        words: list[str] = []
        for token in lexer:
            if token in (";", "&&", "||", "|"):
                out.append(words)
                words = []
            else:
                words.append(token)
        out.append(words)
    return [c for c in out if c]


def unbound_names(tree: ast.AST) -> set[str]:
    """Names a python block reads without defining or importing them: the reader's placeholders
    (`MyViT`, `my_loader`). A block without any runs as it is."""
    bound, read = set(dir(builtins)), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    return read - bound
