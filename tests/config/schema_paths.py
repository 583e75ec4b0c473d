"""The key paths of config/sriovd.schema.json, as the schema's tests name
them (a list's items as [], a.b for nesting, $refs followed): shared by
tests/config/check_schema.py and tests/docs/check_man.py."""


def resolve(schema, node):
    """node with its $ref followed (the referring node's own keywords kept)."""
    while "$ref" in node:
        merged = dict(schema["$defs"][node["$ref"].split("/")[-1]])
        merged.update({k: v for k, v in node.items() if k != "$ref"})
        node = merged
    return node


def _walk(schema, node, path, objects, keys):
    node = resolve(schema, node)
    if "properties" in node:
        objects[path] = node
        for key, sub in node["properties"].items():
            p = f"{path}.{key}" if path else key
            keys[p] = resolve(schema, sub)
            _walk(schema, sub, p, objects, keys)
    if "items" in node:
        _walk(schema, node["items"], path + "[]", objects, keys)


def objects(schema):
    """{path: node} of every mapping of the schema ("" the document)."""
    out = {}
    _walk(schema, schema, "", out, {})
    return out


def keys(schema):
    """{path: node} of every key, sections and values alike."""
    out = {}
    _walk(schema, schema, "", {}, out)
    return out


def is_section(schema, node):
    """A key whose value is a mapping, or a list of mappings."""
    if "items" in node:
        node = resolve(schema, node["items"])
    return "properties" in node
