"""docs/hook.md shows examples/train_mlp.py verbatim, so the documented loop is the tested one."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_the_documented_example_is_the_example_file() -> None:
    doc = (ROOT / "docs" / "hook.md").read_text()
    shown = re.search(r"```python\n(.*?)```", doc, re.S)
    assert shown is not None
    source = (ROOT / "examples" / "train_mlp.py").read_text()
    body = source.split('"""\n\nfrom __future__ import annotations\n\n', 1)[1]
    assert shown.group(1) == body


def test_what_the_docs_call_on_flashrecovery_is_there_after_import_flashrecovery() -> None:
    import flashrecovery
    import flashrecovery.trainer_hooks as hooks

    docs = "".join(p.read_text() for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
    called = set(re.findall(r"\bflashrecovery\.([a-z_]+)\(", docs))
    assert "init_process_group" in called
    for name in called:
        assert getattr(flashrecovery, name) is getattr(hooks, name), name
