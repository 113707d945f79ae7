"""The code examples of docs/*.md, written out as modules, so that the tests run what the docs show."""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"


def example(name: str, doc: str = "plugins.md") -> tuple[str, str]:
    """(relative path, source) of the ```python block whose first line is `# <dir>/<name>.py`."""
    for block in re.findall(r"```python\n(.*?)```", (DOCS / doc).read_text(), flags=re.S):
        first = block.splitlines()[0]
        found = re.fullmatch(rf"# ((?:\w+/)*{re.escape(name)}\.py)", first.strip())
        if found:
            return found.group(1), block
    raise LookupError(f"no example {name}.py in docs/{doc}")


def write_example(folder: Path, name: str, doc: str = "plugins.md") -> str:
    """Write the example under folder (packages get an __init__.py); its dotted module name."""
    rel, source = example(name, doc)
    path = Path(folder) / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    for parent in path.relative_to(folder).parents:
        if str(parent) != ".":
            (Path(folder) / parent / "__init__.py").touch()
    path.write_text(source)
    return rel[: -len(".py")].replace("/", ".")
