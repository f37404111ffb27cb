"""Every complete Python block of README.md and docs/*.md runs as written, so that an
example can never rot. Markers, an HTML comment on the line before a ```python fence:
- none: the block runs in this process (exec);
- `<!-- file: NAME.py -->`: a module the other blocks import, written as NAME.py
  into the folder where every block runs;
- `<!-- script: NAME.py -->`: a program, written as NAME.py there and run as
  `python NAME.py` (its own `__main__`, as a user runs it: examples that start
  processes, which import the script again);
- `<!-- fragment: why -->`: cannot run here (a running vLLM engine): skipped."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from llamarl_core.control import auth

ROOT = Path(__file__).parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FRAGMENT, FILE, SCRIPT = "<!-- fragment:", "<!-- file:", "<!-- script:"


def python_blocks() -> list[tuple[str, str, str, str]]:
    """(where: "FILE.md:line" of the opening fence, the code, its marker kind, the marker's argument) per
    ```python block of every document; kind is "", "fragment", "file" or "script"."""
    blocks = []
    for document in DOCUMENTS:
        lines = document.read_text().splitlines()
        for idx, line in enumerate(lines):
            if line.strip() == "```python":
                end = lines.index("```", idx + 1)
                before = lines[idx - 1].strip() if idx > 0 else ""
                kind, argument = "", ""
                for marker in (FRAGMENT, FILE, SCRIPT):
                    if before.startswith(marker):
                        kind, argument = marker[5:-1], before[len(marker):].split("-->")[0].strip()
                where = f"{document.relative_to(ROOT)}:{idx + 1}"
                blocks.append((where, "\n".join(lines[idx + 1:end]) + "\n", kind, argument))
    return blocks


BLOCKS = python_blocks()
COMPLETE = [(where, code) for where, code, kind, _ in BLOCKS if kind == ""]
SCRIPTS = [(where, code, name) for where, code, kind, name in BLOCKS if kind == "script"]


@pytest.fixture
def readme_folder(tmp_path, monkeypatch):
    """The folder every block runs in, holding every document's file blocks."""
    for _, code, kind, name in BLOCKS:
        if kind == "file":
            (tmp_path / name).write_text(code)
    monkeypatch.chdir(tmp_path)  # a block that writes files writes them here
    # conftest.py's secret is not a reader's: every example passes its own, as written.
    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    return tmp_path


@pytest.mark.parametrize("where, code", COMPLETE, ids=[where for where, _ in COMPLETE])
def test_readme_block_runs_as_written(where, code, readme_folder):
    exec(compile(code, where, "exec"), {"__name__": "readme_" + where.replace("/", "_").replace(".", "_")})


@pytest.mark.parametrize("where, code, name", SCRIPTS, ids=[where for where, _, _ in SCRIPTS])
def test_readme_script_runs_as_written(where, code, name, readme_folder):
    (readme_folder / name).write_text(code)
    done = subprocess.run([sys.executable, name], cwd=readme_folder, capture_output=True, text=True, timeout=600,
                          env={k: v for k, v in os.environ.items() if k != auth.SECRET_ENV})
    assert done.returncode == 0, f"{where} ({name}) exited {done.returncode}:\n{done.stdout}\n{done.stderr}"


def test_readme_markers_say_why_and_fragments_stay_few():
    kinds = [kind for _, _, kind, _ in BLOCKS]
    assert all(argument for _, _, kind, argument in BLOCKS if kind), "a marker names no file / gives no reason"
    names = [argument for _, _, kind, argument in BLOCKS if kind in ("file", "script")]
    assert len(names) == len(set(names)), f"two blocks write the same file: {names}"
    # The sync, sender / receiver, task, FP8 and AIPO examples run; only the vLLM engine's is a fragment.
    assert len(COMPLETE) >= 5 and kinds.count("fragment") <= 1, (len(COMPLETE), kinds)


def test_the_readme_is_a_front_door_and_every_document_is_linked():
    """At most 300 lines, its quick starts runnable blocks, and every page of docs/ linked from it."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    assert sum(1 for where, _ in COMPLETE if where.startswith("README.md:")) >= 3
    for page in DOCUMENTS[1:]:
        assert f"(docs/{page.name})" in readme, f"README.md does not link docs/{page.name}"
