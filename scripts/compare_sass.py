"""Compare the SASS of two builds of the extension, kernel by kernel: the check that a refactor changed no code.

    python3 scripts/compare_sass.py OLD.so NEW.so          # or cuobjdump -sass dumps (*.sass) of them

Kernels are matched by their instruction streams, not their names (a rename of a template, a namespace or a file
changes every mangled name): each kernel of OLD must have one of NEW with the same instructions (addresses and
encodings stripped, symbol names in the body normalised). Prints the unmatched kernels of each side with their
instruction counts, and exits 1 if there are any. Uses the CUDA toolkit's cuobjdump or triton's copy.
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import re
import shutil
import subprocess
import sys
from pathlib import Path

ADDRESS = re.compile(r"/\*[0-9a-f]{4,}\*/")
ENCODING = re.compile(r"/\* 0x[0-9a-f]+ \*/")
SYMBOL = re.compile(r"`\(([^)]*)\)")
ANON_NAMESPACE = re.compile(r"_GLOBAL__N__[0-9a-f]+_\d+_\w+?_[0-9a-f]{8}")


def cuobjdump() -> str:
    found = shutil.which("cuobjdump")
    if found:
        return found
    nvcc = shutil.which("nvcc")
    if nvcc and Path(nvcc).with_name("cuobjdump").exists():
        return str(Path(nvcc).with_name("cuobjdump"))
    import triton  # the wheel ships one

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")


def sass_text(path: Path) -> str:
    if path.suffix == ".sass":
        return path.read_text()
    return subprocess.run([cuobjdump(), "-sass", str(path)], capture_output=True, text=True, check=True).stdout


def kernels(text: str) -> dict[str, list[str]]:
    """Mangled name -> normalised instruction lines."""
    out = {}
    for body in re.split(r"\n\s*Function : ", text)[1:]:
        name, rest = body.split("\n", 1)
        lines = []
        for line in rest.splitlines():
            if not ADDRESS.search(line):  # headers, labels, file trailers: not instructions
                continue
            line = ENCODING.sub("", ADDRESS.sub("", line)).strip()
            lines.append(SYMBOL.sub(lambda m: "`(" + ANON_NAMESPACE.sub("_ANON_", m.group(1)) + ")", line))
        out[name.strip()] = lines
    return out


def digest(lines: list[str]) -> str:
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def short(name: str) -> str:
    return ANON_NAMESPACE.sub("", name)[:140]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    args = ap.parse_args()
    old, new = kernels(sass_text(args.old)), kernels(sass_text(args.new))
    new_by_digest = collections.defaultdict(list)
    for name, lines in new.items():
        new_by_digest[digest(lines)].append(name)
    unmatched_old = []
    for name, lines in old.items():
        names = new_by_digest.get(digest(lines))
        if names:
            names.pop()
        else:
            unmatched_old.append(name)
    unmatched_new = [n for names in new_by_digest.values() for n in names]
    print(f"{len(old)} kernels before, {len(new)} after; {len(old) - len(unmatched_old)} identical")
    for label, names, table in (("only before", unmatched_old, old), ("only after", unmatched_new, new)):
        for name in sorted(names):
            print(f"  {label}: {short(name)} ({len(table[name])} instructions)")
    return 1 if unmatched_old or unmatched_new else 0


if __name__ == "__main__":
    sys.exit(main())
