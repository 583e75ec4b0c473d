#!/usr/bin/python3
"""The JSON Schema of sriovd.yaml (config/sriovd.schema.json), kept in step
with the parser (`sriovd --check-config`, the authority) and with the
configuration reference (docs/configuration.md):

1. Every example - config/*.yaml, the DRA ConfigMap's sriovd.yaml, each
   full configuration in the README and docs/, tests/config/every_key.yaml -
   passes both the parser and the schema.
2. Every bad configuration of tests/config/bad_configs.hpp (written out by
   dump_bad_configs) is refused by the schema too, but for those the schema
   cannot judge (SEMANTIC below: what needs the host, other entries or
   arithmetic); and each of those the schema does accept, so the list stays
   exact.
3. At every mapping the examples reach, the keys the parser allows (asked by
   adding an unknown key and reading its "expected one of" list) are the
   schema's properties there; every object of the schema is reached.
4. Every key path of the schema has a row in docs/configuration.md's
   reference table, and every row names a key of the schema.

    check_schema.py SOURCE_DIR SRIOVD_BINARY DUMP_BAD_CONFIGS_BINARY
"""
import json
import pathlib
import re
import subprocess
import sys
import tempfile

import jsonschema
import yaml

import schema_paths

root = pathlib.Path(sys.argv[1])
sriovd = sys.argv[2]
dump_bad = sys.argv[3]
problems = []

# Bad configurations whose fault a JSON Schema cannot see, by why.
SEMANTIC = {
    # YAML itself: not a document the schema is given.
    "SyntaxError", "EmptyFile",
    # This host: its users and groups.
    "UnknownGroup", "SocketUserUnknown", "SocketGroupUnknown",
    # Another entry: a PF, VF, device, tap, socket or MAC named twice or not
    # configured; a VF's index against its PF's num_vfs or total_vfs.
    "SimulatedDuplicateAddress", "PfConfiguredTwice", "PfNotSimulated", "NumVfsAboveTotalVfs",
    "VfConfiguredTwice", "VfIndexNotBelowNumVfs", "MaxVectorsAboveTheVfs", "DuplicateVfMac",
    "DuplicateVirtioName", "TapUsedTwice", "BackendPfNotConfigured", "BackendVfIsExported",
    "BackendVfNotBelowNumVfs", "BackendVfUsedTwice", "BridgedMacDiffersFromItsVfs",
    "ExportSocketIsControlSocket", "SocketSharedByVirtioAndVf", "PoolUnknownVirtioDevice",
    "PoolVfExportedOverVfioUser", "PoolVfInTwoPools", "PoolVfNotAssigned",
    # Arithmetic between values.
    "AddressSpaceBelowBytes", "MinRateAboveMaxRate", "MetricsPortTooBig",
}


class Yaml12Loader(yaml.SafeLoader):
    """YAML 1.2's core schema, as yaml-cpp and editors read the file: only
    true/false are booleans, 0x.. and 0o.. are integers, no sexagesimals."""


Yaml12Loader.yaml_implicit_resolvers = {}
for tag, regexp, first in [
    ("tag:yaml.org,2002:bool", r"^(?:true|True|TRUE|false|False|FALSE)$", list("tTfF")),
    ("tag:yaml.org,2002:int", r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$", list("-+0123456789")),
    ("tag:yaml.org,2002:float", r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$", list("-+0123456789.")),
    ("tag:yaml.org,2002:null", r"^(?:~|null|Null|NULL|)$", ["~", "n", "N", ""]),
]:
    Yaml12Loader.add_implicit_resolver(tag, re.compile(regexp), first)


def construct_int(loader, node):
    text = loader.construct_scalar(node)
    if text.startswith("0x"):
        return int(text, 16)
    if text.startswith("0o"):
        return int(text[2:], 8)
    return int(text, 10)


Yaml12Loader.add_constructor("tag:yaml.org,2002:int", construct_int)


def load(text):
    return yaml.load(text, Loader=Yaml12Loader)


schema = json.loads((root / "config" / "sriovd.schema.json").read_text())
jsonschema.Draft202012Validator.check_schema(schema)
validator = jsonschema.Draft202012Validator(schema)


def schema_errors(doc):
    return sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path))


def check_config(text, env=None):
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as t:
        t.write(text)
        t.flush()
        r = subprocess.run([sriovd, "--check-config", t.name], capture_output=True, text=True, env=env)
        return r.returncode, r.stdout + r.stderr


# --- 1. the examples -------------------------------------------------------
def markdown_configs(path):
    out = []
    for i, block in enumerate(re.findall(r"^ *```yaml\n(.*?)^ *```", path.read_text(), re.S | re.M)):
        lines = block.splitlines()
        indent = min((len(l) - len(l.lstrip()) for l in lines if l.strip()), default=0)
        body = "\n".join(l[indent:] for l in lines) + "\n"
        if body.lstrip().startswith("version: 1"):
            out.append((f"{path.relative_to(root)} block {i + 1}", body))
    return out


examples = []
for f in sorted((root / "config").glob("*.yaml")):
    examples.append((str(f.relative_to(root)), f.read_text()))
examples.append(("tests/config/every_key.yaml", (root / "tests/config/every_key.yaml").read_text()))
for f in [root / "README.md"] + sorted((root / "docs").glob("*.md")):
    examples += markdown_configs(f)
for f in sorted((root / "docs" / "man").glob("*.scd")):  # a man page's example: a ``` block
    for i, block in enumerate(re.findall(r"^```\n(.*?)^```", f.read_text(), re.S | re.M)):
        if block.startswith("version: 1"):
            examples.append((f"{f.relative_to(root)} example {i + 1}", block))
for doc in yaml.safe_load_all((root / "config/kubernetes/dra-driver.yaml").read_text()):
    if doc and doc.get("kind") == "ConfigMap":
        for key, text in doc.get("data", {}).items():
            if key.endswith(".yaml"):
                examples.append((f"config/kubernetes/dra-driver.yaml ConfigMap {key}", text))

tmp = tempfile.TemporaryDirectory()
kubeconfig = pathlib.Path(tmp.name) / "kubeconfig"
kubeconfig.write_text("apiVersion: v1\nkind: Config\nclusters: [{name: c, cluster: {server: 'https://127.0.0.1:6443'}}]\n"
                      "users: [{name: u, user: {token: t}}]\ncontexts: [{name: x, context: {cluster: c, user: u}}]\n"
                      "current-context: x\n")
env = {"PATH": "/usr/bin:/bin", "KUBECONFIG": str(kubeconfig), "NODE_NAME": "node-1"}

for name, text in examples:
    rc, out = check_config(text, env)
    if rc != 0:
        problems.append(f"{name}: the parser refuses an example: {out.strip()}")
    for e in schema_errors(load(text)):
        problems.append(f"{name}: the schema refuses an example at {'/'.join(map(str, e.absolute_path))}: {e.message}")
print(f"schema: {len(examples)} examples checked against the parser and the schema: "
      + ", ".join(name for name, _ in examples))

# --- 2. the bad configurations ---------------------------------------------
bad_dir = pathlib.Path(tmp.name) / "bad"
bad_dir.mkdir()
subprocess.run([dump_bad, str(bad_dir)], check=True)
bad = sorted(bad_dir.glob("*.yaml"))
caught = 0
for f in bad:
    name = f.stem
    try:
        doc = load(f.read_text())
        refused = doc is None or bool(schema_errors(doc))
    except yaml.YAMLError:
        refused = True
    if name in SEMANTIC:
        if refused and name not in ("SyntaxError", "EmptyFile"):
            problems.append(f"bad config {name}: the schema refuses it now - take it off SEMANTIC")
    elif not refused:
        problems.append(f"bad config {name}: the parser refuses it, the schema accepts it:\n{f.read_text()}")
    else:
        caught += 1
for name in SEMANTIC - {f.stem for f in bad}:
    problems.append(f"SEMANTIC names {name}, which is no bad config (renamed or gone?)")
print(f"schema: {len(bad)} bad configurations, {caught} refused by the schema, {len(SEMANTIC)} only by the parser")


# --- 3. the keys at every mapping ------------------------------------------
objects = schema_paths.objects(schema)
reached = set()
probe_key = "zz_not_a_key"


def walk(doc, path, at):
    """Yields (key path, accessor list) of every mapping in doc."""
    if isinstance(doc, dict):
        yield path, at
        for k, v in doc.items():
            yield from walk(v, f"{path}.{k}" if path else k, at + [k])
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from walk(v, path + "[]", at + [i])


probed = 0
for name, text in examples:
    doc = load(text)
    for path, at in walk(doc, "", []):
        if path not in objects:
            problems.append(f"{name}: a mapping at '{path}' that the schema does not describe")
            continue
        if path in reached:
            continue
        copy = load(text)
        target = copy
        for a in at:
            target = target[a]
        target[probe_key] = 1
        _, out = check_config(yaml.safe_dump(copy, sort_keys=False), env)
        m = re.search(r"unknown key '" + probe_key + r"' \(expected one of: ([^)]*)\)", out)
        probed += 1
        if not m:
            problems.append(f"{name}: the parser takes an unknown key at '{path}'? {out.strip()}")
            continue
        parser_keys = set(m.group(1).split(", "))
        schema_keys = set(objects[path]["properties"])
        if parser_keys != schema_keys:
            problems.append(f"'{path}': the parser allows {sorted(parser_keys - schema_keys)} that the schema lacks, "
                            f"the schema has {sorted(schema_keys - parser_keys)} that the parser refuses")
        reached.add(path)
for path in sorted(set(objects) - reached):
    problems.append(f"'{path or 'document'}': no example reaches this object of the schema (add it to "
                    "tests/config/every_key.yaml)")
print(f"schema: {probed} mappings probed for their keys, {len(reached)} of {len(objects)} schema objects reached")


# --- 4. the reference table ------------------------------------------------
all_keys = schema_paths.keys(schema)
# A section's row is its keys' rows: only values need one of their own.
leaf_paths = {p for p, node in all_keys.items() if not schema_paths.is_section(schema, node)}
section_paths = set(all_keys) - leaf_paths
ref = (root / "docs" / "configuration.md").read_text()
table = ref[ref.index("## Configuration reference"):]
table = table[:table.index("\n## ", 10)]
documented = set()
for line in table.splitlines():
    if not line.startswith("| `"):
        continue
    first = line.split("|")[1]
    last = None
    for item in re.findall(r"`([^`]+)`", first):
        if item.startswith(".") and last:
            item = last.rsplit(".", 1)[0] + item
        item = item.rstrip("[]") if item.endswith("[]") else item
        documented.add(item)
        last = item
for p in sorted(leaf_paths - documented):
    if p.endswith("[]"):
        continue
    problems.append(f"docs/configuration.md: no row for '{p}'")
for p in sorted(documented - leaf_paths - section_paths):
    problems.append(f"docs/configuration.md: a row for '{p}', which is no key of the schema")
print(f"schema: {len(leaf_paths)} key paths, {len(documented)} documented")

for p in problems:
    print(p)
print(f"{len(problems)} problems")
sys.exit(1 if problems else 0)
