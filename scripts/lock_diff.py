"""Prints what changed between two lock files: `python lock_diff.py NAME OLD NEW` (scripts/lock)."""

import re
import sys


def pins(path: str) -> dict[str, str]:
    out = {}
    for line in open(path, encoding="utf-8"):
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;]+)", line)
        if m:
            out[re.sub(r"[-_.]+", "-", m.group(1)).lower()] = m.group(2)
    return out


def main() -> None:
    name, old_path, new_path = sys.argv[1:4]
    old, new = pins(old_path), pins(new_path)
    changes = [f"  {p}: {old.get(p, '-')} -> {new.get(p, '-')}"
               for p in sorted(old.keys() | new.keys()) if old.get(p) != new.get(p)]
    print(f"{name}: {len(new)} packages, " + (f"{len(changes)} changed" if changes else "unchanged"))
    print("\n".join(changes)) if changes else None


if __name__ == "__main__":
    main()
