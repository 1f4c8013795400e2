"""Every ```python block of docs/*.md runs, so the examples cannot rot.

Each file's blocks run in order in one namespace (a page reads as one script), in a fresh
working directory. Code that is not meant to run is fenced as ```text, ```bash or ```toml.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_doc_examples_run(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    text = path.read_text(encoding="utf-8")
    namespace = {"__name__": f"docs_{path.stem}"}
    for block in BLOCK.finditer(text):
        # Padded so a traceback names the line of the .md file; dont_inherit: this module's
        # `from __future__ import annotations` must not leak into the examples.
        code = "\n" * text.count("\n", 0, block.start(1)) + block.group(1)
        exec(compile(code, str(path), "exec", dont_inherit=True), namespace)
