#!/usr/bin/python3
"""The man pages, checked: each renders with man(1) without a warning; every
option and command the binaries' --help prints (each command's own --help
too) is in its page; every key of the configuration's schema is in
sriovd.yaml(5).

    check_man.py MAN_DIR SRIOVD SRIOVCTL SRIOVD_GUEST SCHEMA
"""
import json
import os
import pathlib
import re
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "config"))
import schema_paths  # noqa: E402 (tests/config/schema_paths.py)

man_dir = pathlib.Path(sys.argv[1])
binaries = {"sriovd.8": sys.argv[2], "sriovctl.8": sys.argv[3], "sriovd-guest.1": sys.argv[4]}
schema = json.loads(pathlib.Path(sys.argv[5]).read_text())
problems = []
env = dict(os.environ, LC_ALL="C.UTF-8", MANWIDTH="400", MAN_KEEP_FORMATTING="", MANPAGER="cat", PAGER="cat")


def render(page):
    path = man_dir / f"man{page.rsplit('.', 1)[1]}" / page
    r = subprocess.run(["man", "--warnings", "-l", str(path)], capture_output=True, text=True, env=env)
    if r.returncode != 0 or r.stderr.strip():
        problems.append(f"{page}: man reports (exit {r.returncode}): {r.stderr.strip()}")
    text = re.sub(r".\x08", "", r.stdout)
    if "NAME" not in text or "SEE ALSO" not in text:
        problems.append(f"{page}: no NAME or SEE ALSO section in what man rendered")
    return text


def help_items(binary, args=()):
    """Options and subcommands the --help of `binary args` prints."""
    r = subprocess.run([binary, *args, "--help"], capture_output=True, text=True)
    if r.returncode != 0:
        problems.append(f"{binary} {' '.join(args)} --help: exit {r.returncode}")
    options = set(re.findall(r"^\s+(?:-\w,)?(--[a-z][-a-z]*)", r.stdout, re.M))
    commands = []
    if "Subcommands:" in r.stdout:
        for line in r.stdout.split("Subcommands:", 1)[1].splitlines():
            m = re.match(r"^  ([a-z][-a-z]*)\s", line)
            if m:
                commands.append(m.group(1))
    return options, commands


checked = 0
for page, binary in binaries.items():
    text = render(page)
    options, commands = help_items(binary)
    for c in commands:
        sub_options, _ = help_items(binary, (c,))
        options |= sub_options
        if not re.search(r"(^|\s)" + re.escape(c) + r"(\s|$)", text, re.M):
            problems.append(f"{page}: the command '{c}' that {pathlib.Path(binary).name} --help lists is not in the page")
    for o in sorted(options):
        checked += 1
        if not re.search(re.escape(o) + r"(?![-a-z])", text):
            problems.append(f"{page}: the option '{o}' that {pathlib.Path(binary).name} --help lists is not in the page")


yaml_page = render("sriovd.yaml.5")
# A path is written whole, or as ".key" after a path of the same parent.
written = set()
for line in yaml_page.splitlines():
    last = None
    for item in re.findall(r"([a-z_]+(?:\[\])?(?:\.[a-z_]+(?:\[\])?)*|\.[a-z_]+)", line):
        if item.startswith(".") and last:
            item = last.rsplit(".", 1)[0] + item
        written.add(item)
        last = item
keys = set(schema_paths.keys(schema))
for k in sorted(keys):
    leafy = k.rstrip("[]")
    if k not in written and leafy not in written and not any(w.startswith(leafy + ".") or w.startswith(leafy + "[]")
                                                            for w in written):
        problems.append(f"sriovd.yaml.5: the key '{k}' of the schema is not in the page")

for p in problems:
    print(p)
print(f"man: {len(binaries) + 1} pages rendered, {checked} options and {len(keys)} configuration keys looked up, "
      f"{len(problems)} problems")
sys.exit(1 if problems else 0)
