"""Validate MCP messages against the official JSON Schemas of each protocol version.

The schemas in ``tests/mcp_schemas/<version>.json`` are copied unchanged from
github.com/modelcontextprotocol/modelcontextprotocol, ``schema/<version>/schema.json``
at commit b0f60ba5409db7a6582440a7b473cc0398890f15 (2026-08-22).  See
``tests/mcp_schemas/README.md``.

The validator is a small stdlib-only implementation of the JSON Schema subset
those files (and ferrus's tool output schemas) use: ``$ref`` (local),
``type``, ``properties``, ``required``, ``additionalProperties``, ``items``,
``anyOf``, ``allOf``, ``oneOf``, ``const``, ``enum``, ``minimum``, ``maximum``,
``minItems``, ``maxItems``.  ``format`` and annotations are ignored.

``strict=True`` also refuses properties a schema object does not name when it
says nothing about ``additionalProperties``.  The spec's schemas leave extra
fields open, so a plain validator cannot tell that ``title`` did not exist in
2024-11-05; strict mode does (issue #12 item 7).
"""

import json
import os

SCHEMA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mcp_schemas")
VERSIONS = ("2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25", "2026-07-28")
MODERN = "2026-07-28"

_cache = {}


def load(version):
    if version not in _cache:
        with open(os.path.join(SCHEMA_DIR, version + ".json"), encoding="utf-8") as handle:
            _cache[version] = json.load(handle)
    return _cache[version]


def definitions(version):
    schema = load(version)
    return schema.get("$defs") or schema.get("definitions")


_TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "integer": lambda v: (isinstance(v, int) and not isinstance(v, bool))
    or (isinstance(v, float) and v.is_integer()),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "null": lambda v: v is None,
}


def _resolve(root, ref):
    if not ref.startswith("#/"):
        raise ValueError("only local $ref is supported: %s" % ref)
    node = root
    for part in ref[2:].split("/"):
        node = node[part.replace("~1", "/").replace("~0", "~")]
    return node


def _declared(schema, root):
    """Property names an object schema (with its $ref and allOf parts) defines;
    None when it leaves other properties open or defines none itself."""
    if not isinstance(schema, dict) or "additionalProperties" in schema:
        return None
    names = set(schema.get("properties", ()))
    parts = list(schema.get("allOf", ()))
    if "$ref" in schema:
        parts.append(_resolve(root, schema["$ref"]))
    for part in parts:
        more = _declared(part, root)
        if more is None and isinstance(part, dict) and (
                "additionalProperties" in part or "properties" in part):
            return None
        names |= more or set()
    return names if (names or "properties" in schema) else None


def errors(instance, schema, root=None, strict=False, path="$", whole=True):
    """Every way ``instance`` breaks ``schema``, as "path: problem" strings.

    ``whole`` is False while checking a part of a schema ($ref target, allOf
    branch): strict mode judges unknown properties against the union of the
    parts, at the node that combines them."""
    root = schema if root is None else root
    found = []
    if schema is True or schema == {}:
        return found
    if schema is False:
        return ["%s: no value is allowed here" % path]
    if strict and whole and isinstance(instance, dict):
        known = _declared(schema, root)
        if known is not None:
            for name in instance:
                if name not in known:
                    found.append("%s.%s: property not defined by this version's schema"
                                 % (path, name))
    if "$ref" in schema:
        found += errors(instance, _resolve(root, schema["$ref"]), root, strict, path, False)
    kind = schema.get("type")
    if kind is not None:
        kinds = kind if isinstance(kind, list) else [kind]
        if not any(_TYPES[k](instance) for k in kinds):
            return found + ["%s: expected %s, got %s" % (path, "/".join(kinds),
                                                         type(instance).__name__)]
    if "const" in schema and not _equal(instance, schema["const"]):
        found.append("%s: expected %r, got %r" % (path, schema["const"], instance))
    if "enum" in schema and not any(_equal(instance, v) for v in schema["enum"]):
        found.append("%s: %r is not one of %r" % (path, instance, schema["enum"]))
    if _TYPES["number"](instance):
        if "minimum" in schema and instance < schema["minimum"]:
            found.append("%s: %r < minimum %r" % (path, instance, schema["minimum"]))
        if "maximum" in schema and instance > schema["maximum"]:
            found.append("%s: %r > maximum %r" % (path, instance, schema["maximum"]))
    if isinstance(instance, dict):
        properties = schema.get("properties", {})
        for name in schema.get("required", ()):
            if name not in instance:
                found.append("%s: missing required property %r" % (path, name))
        extra = schema.get("additionalProperties")
        for name, value in instance.items():
            sub = "%s.%s" % (path, name)
            if name in properties:
                found += errors(value, properties[name], root, strict, sub)
            elif extra is not None:
                found += errors(value, extra, root, strict, sub)
    if isinstance(instance, list):
        if "items" in schema:
            for index, value in enumerate(instance):
                found += errors(value, schema["items"], root, strict, "%s[%d]" % (path, index))
        if "minItems" in schema and len(instance) < schema["minItems"]:
            found.append("%s: fewer than %d items" % (path, schema["minItems"]))
        if "maxItems" in schema and len(instance) > schema["maxItems"]:
            found.append("%s: more than %d items" % (path, schema["maxItems"]))
    for sub_schema in schema.get("allOf", ()):
        found += errors(instance, sub_schema, root, strict, path, False)
    for key in ("anyOf", "oneOf"):
        if key in schema:
            results = [errors(instance, s, root, strict, path) for s in schema[key]]
            matching = [r for r in results if not r]
            if not matching:
                best = min(results, key=len)
                found.append("%s: matches no alternative of %s; closest: %s"
                             % (path, key, "; ".join(best[:4])))
            elif key == "oneOf" and len(matching) > 1:
                found.append("%s: matches %d alternatives of oneOf" % (path, len(matching)))
    return found


def _equal(a, b):
    return type(a) is type(b) and a == b or (
        _TYPES["number"](a) and _TYPES["number"](b) and a == b)


# Which result definition answers which request method.
RESULT_OF = {
    "initialize": "InitializeResult",
    "ping": "EmptyResult",
    "logging/setLevel": "EmptyResult",
    "tools/list": "ListToolsResult",
    "tools/call": "CallToolResult",
    "resources/list": "ListResourcesResult",
    "resources/templates/list": "ListResourceTemplatesResult",
    "resources/read": "ReadResourceResult",
    "prompts/list": "ListPromptsResult",
    "prompts/get": "GetPromptResult",
    "server/discover": "DiscoverResult",
}

NOTIFICATION_OF = {
    "notifications/progress": "ProgressNotification",
    "notifications/message": "LoggingMessageNotification",
}


def message_errors(version, message, method=None):
    """Problems of one server->client message under ``version``.

    ``method`` is the request a response answers (None when unknown); its
    result is then checked against that method's result definition, strictly."""
    defs = definitions(version)
    root = load(version)
    ref = "#/$defs/" if "$defs" in root else "#/definitions/"

    def check(value, name, strict=True, path="$"):
        if name not in defs:
            return ["%s: %s does not exist in %s" % (path, name, version)]
        return errors(value, {"$ref": ref + name}, root, strict, path)

    if isinstance(message, list):
        if version != "2025-03-26":
            return ["$: a batch (JSON array) is not a message in %s" % version]
        if not message:
            return ["$: an empty batch response"]
        found = []
        for index, item in enumerate(message):
            found += message_errors(version, item, method.get(index) if isinstance(
                method, dict) else None)
        return found
    if "error" in message and message.get("id", 0) is None and "JSONRPCError" in defs:
        # Before 2025-11-25 the schema requires a string or integer id even when
        # the request's id could not be read; ferrus sends null there, as
        # JSON-RPC 2.0 (section 5) says.  A deliberate deviation (README, MCP).
        message = dict(message, id=0)
    found = check(message, "JSONRPCMessage", strict=False)
    if found:
        return found
    if "error" in message:
        name = "JSONRPCErrorResponse" if "JSONRPCErrorResponse" in defs else "JSONRPCError"
        if (message["error"] or {}).get("code") == -32022 and version == MODERN:
            name = "UnsupportedProtocolVersionError"
        return check(message, name)
    if "result" in message:
        envelope = "JSONRPCResultResponse" if "JSONRPCResultResponse" in defs else \
            "JSONRPCResponse"
        found = check(message, envelope, strict=False)
        if method in RESULT_OF:
            found += check(message["result"], RESULT_OF[method], path="$.result")
        return found
    if "method" in message and "id" not in message:
        name = NOTIFICATION_OF.get(message["method"], "ServerNotification")
        if "jsonrpc" not in (defs.get(name, {}).get("properties") or {}):
            # Before 2025-11-25 notification definitions leave the envelope to
            # JSONRPCNotification (checked above).
            message = {k: v for k, v in message.items() if k != "jsonrpc"}
        return check(message, name)
    return ["$: a server must not send requests in these tests: %r" % (message,)]


def structured_errors(structured, output_schema):
    """Problems of a tool's structuredContent against its declared outputSchema."""
    return errors(structured, output_schema, output_schema, strict=False, path="$.structured")
