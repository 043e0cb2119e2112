"""Checks that every relative link and image in the repository's Markdown files points at a file or folder that
exists (anchors are not checked). Run from the repository root: python docs/check_links.py"""
import re
import subprocess
import sys
from pathlib import Path

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def broken_links(root: Path) -> list[str]:
    files = subprocess.run(["git", "ls-files", "*.md"], cwd=root, capture_output=True, text=True, check=True)
    bad = []
    for name in files.stdout.split():
        text = re.sub(r"```.*?```", "", (root / name).read_text(encoding="utf-8"), flags=re.S)  # code blocks
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a URL or an anchor on the same page
            path = target.split("#")[0]
            if not (root / name).parent.joinpath(path).exists():
                bad.append(f"{name}: {target}")
    return bad


if __name__ == "__main__":
    problems = broken_links(Path.cwd())
    print("\n".join(problems) or "every relative link resolves")
    sys.exit(1 if problems else 0)
