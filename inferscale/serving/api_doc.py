"""Render ``docs/api-reference.md`` from the memory API's OpenAPI document.

The routes (``memory_api.py``, ``mem0_api.py``) and their models are the one source of truth:
this module builds a FastAPI app with just those routers, asks it for its OpenAPI document (what
a running server publishes at ``/openapi.json``, less vLLM's own routes) and writes one section
per route (parameters, body, answers) and one table per model. ``tests/unit/test_docs.py``
fails when the page is out of date: ``python -m inferscale.serving.api_doc``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI

from inferscale.core.settings_doc import write_page

DOC_PATH = Path(__file__).resolve().parents[2] / "docs" / "api-reference.md"
HEADER = """# Memory API reference

Generated from the server's OpenAPI document by `python -m inferscale.serving.api_doc` (do not
edit by hand; `tests/unit/test_docs.py` checks it). A running server publishes the same document
at `/openapi.json` (with vLLM's routes); what the routes mean, with examples:
[the memory API](api.md) and [from Mem0](from-mem0.md). Every route needs a key
([security](security.md)); every refusal is an `ErrorResponse`: a request that fails validation
is a 400 on the server (vLLM's handler), never the 422 FastAPI declares for it.
"""


def openapi() -> dict[str, Any]:
    """The memory routes' OpenAPI document."""
    from inferscale.serving import mem0_api
    from inferscale.serving.memory_api import router

    app = FastAPI(title="InferScale memory API", version="1")
    app.include_router(router)
    app.include_router(mem0_api.router)
    return app.openapi()


def _type(schema: dict[str, Any]) -> str:
    """A schema as a short type (``string <= 256``, ``Fact``, ``list of Hit``)."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1].rsplit("__", 1)[-1]
        return f"[{name}](#{name.lower()})"
    if "anyOf" in schema:
        return " \\| ".join(_type(option) for option in schema["anyOf"])
    kind = schema.get("type", "any")
    if kind == "array":
        return f"list of {_type(schema.get('items', {}))}"
    if kind == "object" and "additionalProperties" in schema:
        extra = schema["additionalProperties"]
        return f"object of {_type(extra)}" if isinstance(extra, dict) else "object"
    bounds = [f"{word} {schema[key]}" for key, word in (
        ("minLength", ">="), ("maxLength", "<="), ("minimum", ">="), ("maximum", "<="),
        ("exclusiveMinimum", ">"), ("exclusiveMaximum", "<"), ("minItems", "items >="),
        ("maxItems", "items <=")) if key in schema]
    if "enum" in schema:
        bounds.append("one of " + ", ".join(f"`{v}`" for v in schema["enum"]))
    if "const" in schema:
        bounds.append(f"`{schema['const']}`")
    if schema.get("format"):
        bounds.append(schema["format"])
    return " ".join([kind, *bounds])


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _operation(path: str, method: str, op: dict[str, Any]) -> str:
    out = [f"### `{method.upper()} {path}`\n", f"{_cell(op.get('summary', ''))}.\n"]
    if op.get("description"):
        out.append(_cell(op["description"]).replace("``", "`") + "\n")
    if op.get("parameters"):
        out.append("| parameter | in | required | type |\n|---|---|---|---|")
        out += [f"| `{p['name']}` | {p['in']} | {'yes' if p.get('required') else 'no'} | "
                f"{_type(p.get('schema', {}))} |" for p in op["parameters"]]
        out.append("")
    body = op.get("requestBody", {}).get("content", {})
    for content_type, media in body.items():
        out.append(f"Body (`{content_type}`): {_type(media.get('schema', {}))}.\n")
    answers = []
    for status, response in op.get("responses", {}).items():
        contents = response.get("content", {})
        shown = ", ".join(f"{_type(media.get('schema', {}))} (`{kind}`)" if media.get("schema")
                          else f"`{kind}`" for kind, media in contents.items()) or "no body"
        answers.append(f"| {status} | {_cell(response.get('description', ''))} | {shown} |")
    out.append("| status | meaning | body |\n|---|---|---|\n" + "\n".join(answers) + "\n")
    return "\n".join(out)


def _model(name: str, schema: dict[str, Any]) -> str:
    title = name.rsplit("__", 1)[-1]
    out = [f"### {title}\n"]
    if schema.get("description"):
        out.append(_cell(schema["description"]).replace("``", "`") + "\n")
    required = set(schema.get("required", []))
    fields = schema.get("properties", {})
    if fields:
        out.append("| field | type | required |\n|---|---|---|")
        out += [f"| `{field}` | {_type(spec)} | {'yes' if field in required else 'no'} |"
                for field, spec in fields.items()]
        out.append("")
    return "\n".join(out)


def api_markdown() -> str:
    """The page, from the routes' OpenAPI document."""
    spec = openapi()
    out = [HEADER]
    for tag, title in (("memory", "Native routes"), ("mem0", "Mem0's routes")):
        out.append(f"## {title}\n")
        for path, methods in spec["paths"].items():
            out += [_operation(path, method, op) for method, op in methods.items()
                    if tag in op.get("tags", [])]
    out.append("## Models\n")
    schemas = spec.get("components", {}).get("schemas", {})
    out += [_model(name, schemas[name]) for name in sorted(schemas, key=lambda n: n.rsplit(
        "__", 1)[-1])]
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write the page (to ``docs/api-reference.md``, or the path given)."""
    return write_page(api_markdown(), DOC_PATH, argv)


if __name__ == "__main__":
    raise SystemExit(main())
