#!/usr/bin/python3
"""The documentation's promises, checked: every relative link in README.md,
CHANGELOG.md and docs/*.md names a file that exists (and an anchor, when it
gives one, a heading of that file), and every complete configuration in the
README (a ```yaml block starting with "version: 1") passes
`sriovd --check-config`.

    check_docs.py SOURCE_DIR SRIOVD_BINARY
"""
import pathlib
import re
import subprocess
import sys
import tempfile

root = pathlib.Path(sys.argv[1])
sriovd = sys.argv[2]
# The pictures of docs/ are rendered by the build (the `docs` target) into
# BUILD/docs, next to copies of the pages: an image link of a page there
# resolves in that tree.
rendered = pathlib.Path(sriovd).resolve().parent.parent / "docs"
problems = []


def anchors(path):
    out = set()
    for line in path.read_text().splitlines():
        m = re.match(r"^#+\s+(.*)$", line)
        if m:
            a = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            out.add(a)
    return out


files = [root / "README.md", root / "CHANGELOG.md"] + sorted((root / "docs").glob("*.md"))
for f in files:
    text = f.read_text()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^[a-z]+://", target) or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        dest = (f.parent / path).resolve() if path else f
        if not dest.exists() and f.parent.name == "docs" and (rendered / path).exists():
            continue  # a picture the build rendered
        if not dest.exists():
            problems.append(f"{f.relative_to(root)}: link to {target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{f.relative_to(root)}: link to {target}: no such heading")

readme = (root / "README.md").read_text()
blocks = re.findall(r"```yaml\n(.*?)```", readme, re.S)
checked = 0
for i, block in enumerate(blocks):
    body = "\n".join(l[3:] if l.startswith("   ") else l for l in block.splitlines())
    if not body.lstrip().startswith("version: 1"):
        continue
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as t:
        t.write(body)
        t.flush()
        r = subprocess.run([sriovd, "--check-config", t.name], capture_output=True, text=True)
        checked += 1
        if r.returncode != 0:
            problems.append(f"README.md: configuration block {i + 1} fails --check-config: {r.stdout}{r.stderr}")

for p in problems:
    print(p)
print(f"docs: {len(files)} files, {checked} README configurations checked, {len(problems)} problems")
sys.exit(1 if problems or checked == 0 else 0)
