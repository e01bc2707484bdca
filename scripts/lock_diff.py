"""Lock files as {package: version}, and what changed between two of them.

``python lock_diff.py NAME OLD NEW`` prints ``package: old -> new`` (scripts/lock, and
scripts/test_latest against a ``pip freeze``); ``parse_lock`` is also what
tests/core/test_env_lock.py reads the locks with."""

import re
import sys


def norm(name: str) -> str:
    """A package name as the index compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_lock(text: str) -> dict[str, str]:
    """{normalized name: version} of a ``uv pip compile`` lock or a ``pip freeze``; a line that
    is neither a comment nor ``name==version`` is an error."""
    pins = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?==([^\s;]+)(\s*;.*)?", line)
        if not m:
            raise ValueError(f"lock line {line!r}: expected name==version")
        pins[norm(m.group(1))] = m.group(3)
    return pins


def main() -> None:
    name, old_path, new_path = sys.argv[1:4]
    old, new = (parse_lock(open(p, encoding="utf-8").read()) for p in (old_path, new_path))
    changes = [
        f"  {p}: {old.get(p, '-')} -> {new.get(p, '-')}"
        for p in sorted(old.keys() | new.keys())
        if old.get(p) != new.get(p)
    ]
    print(f"{name}: {len(new)} packages, " + (f"{len(changes)} changed" if changes else "unchanged"))
    if changes:
        print("\n".join(changes))


if __name__ == "__main__":
    main()
