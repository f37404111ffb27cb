"""Every complete Python block of README.md runs as written, so that an example can
never rot. A block that cannot run here (a running vLLM engine) is marked by an
HTML comment on the line before its fence, `<!-- fragment: why -->`, and skipped."""

from pathlib import Path

import pytest

README = Path(__file__).parents[1] / "README.md"
FRAGMENT = "<!-- fragment:"


def python_blocks() -> list[tuple[int, str, bool]]:
    """(line of the opening fence, the code, whether it is marked a fragment) per ```python block."""
    lines = README.read_text().splitlines()
    blocks = []
    for idx, line in enumerate(lines):
        if line.strip() == "```python":
            end = lines.index("```", idx + 1)
            fragment = idx > 0 and lines[idx - 1].startswith(FRAGMENT)
            blocks.append((idx + 1, "\n".join(lines[idx + 1:end]) + "\n", fragment))
    return blocks


BLOCKS = python_blocks()
COMPLETE = [(line, code) for line, code, fragment in BLOCKS if not fragment]


@pytest.mark.parametrize("line, code", COMPLETE, ids=[f"README.md:{line}" for line, _ in COMPLETE])
def test_readme_block_runs_as_written(line, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a block that writes files writes them here
    exec(compile(code, f"README.md:{line}", "exec"), {"__name__": f"readme_{line}"})


def test_readme_fragments_say_why_and_stay_few():
    fragments = [line for line, _, fragment in BLOCKS if fragment]
    reasons = README.read_text().split(FRAGMENT)[1:]
    assert all(reason.split("-->")[0].strip() for reason in reasons), "a fragment marker gives no reason"
    # The sync, sender / receiver, task, FP8 and AIPO examples run; only the vLLM engine's is a fragment.
    assert len(COMPLETE) >= 5 and len(fragments) <= 1, (len(COMPLETE), fragments)
