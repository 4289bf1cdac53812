"""The comparison server: ferrus's tool names on the official MCP Python SDK.

Run with the SDK's interpreter (bench/run.py starts it from the bench's
scratch virtualenv):

    python sdk_server.py --state .ferrus/STATE.json --tools '<json>'

``--tools`` is a JSON list of {"name", "description", "params": [[name,
required], ...]} taken from ``ferrus.tools_for_role(...)``, so the SDK server
lists exactly ferrus's tools with the same argument names.  Every body is
trivial except ``status``, which reads and parses the state file like ferrus
does, so a status round trip does comparable work on both servers.

Works with mcp 1.x (FastMCP) and 2.x (MCPServer).
"""

import argparse
import json
import sys
from typing import Optional

try:  # mcp >= 2
    from mcp.server.mcpserver import MCPServer as _Server
except ImportError:  # mcp 1.x
    from mcp.server.fastmcp import FastMCP as _Server


def _make_tool(name, params):
    """A function whose signature has the tool's parameters (strings) and returns "ok"."""
    required = [p for p, req in params if req]
    optional = [p for p, req in params if not req]
    signature = ", ".join(["%s: str" % p for p in required]
                          + ["%s: Optional[str] = None" % p for p in optional])
    namespace = {"Optional": Optional}
    exec("def %s(%s) -> str:\n    return %r\n" % (name, signature, "ok"), namespace)
    return namespace[name]


def build(state_path, tools):
    server = _Server("ferrus-sdk-bench")

    def status() -> dict:
        with open(state_path, "r", encoding="utf-8") as handle:
            return json.load(handle)

    for spec in tools:
        name = spec["name"]
        fn = status if name == "status" else _make_tool(name, spec.get("params", []))
        server.add_tool(fn, name=name, description=spec.get("description") or name)
    return server


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--state", required=True)
    parser.add_argument("--tools", required=True)
    args = parser.parse_args(argv)
    build(args.state, json.loads(args.tools)).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
