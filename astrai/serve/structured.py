"""The structured-output fields of both APIs as one grammar per request.

OpenAI's `response_format` (json_object, json_schema), the vLLM extra fields (`structured_outputs`
and the older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`) and a tool
choice (OpenAI's `required` / named / `auto`, Anthropic's `any` / `tool` / `auto`) each become a
`Constraint` (see astrai.infer.constraints). A forced tool call is the call in the chat
template's form, `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`, with the
arguments held to the function's parameters; `auto` lets the model write either plain text
(without a call tag) or valid calls.
"""

from __future__ import annotations

import json

from astrai.infer.constraints import (
    JSON_STYLE,
    Constraint,
    ConstraintError,
    choice,
    json_object,
    json_schema,
    lark,
    regex,
    start_constraint,
)
from astrai.serve.errors import bad_request
from astrai.serve.schemas_openai import JsonObjectFormat, JsonSchemaFormat
from astrai.serve.tools import CLOSE, OPEN

# Text without a call tag: what `auto` lets the model write instead of calls.
_PLAIN_TEXT = "TEXT: /(?s:.+)/ & ~/(?s:.*<tool_call>.*)/"


def call_schema(name: str, parameters: dict | None) -> dict:
    """The JSON of one call of function `name`. The parameters' own `$defs` move to the root,
    where their `#/$defs/...` references point."""
    arguments = dict(parameters) if parameters else {"type": "object"}
    defs = arguments.pop("$defs", None)
    schema = {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
    return {"$defs": defs, **schema} if defs else schema


def tool_constraint(
    functions: dict[str, dict | None], mode: str, name: str | None = None, parallel: bool = True
) -> Constraint:
    """Calls of the functions (name -> parameters schema). mode "required": at least one call,
    of any of them; "named": a call of `name`; "auto": plain text or calls."""
    picked = {name: functions[name]} if mode == "named" else functions
    schemas = [call_schema(n, p) for n, p in picked.items()]
    one = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    one = {"x-guidance": JSON_STYLE, **one}
    calls = 'call ("\\n" call)*' if parallel else "call"
    rules = [
        "start: TEXT | calls" if mode == "auto" else "start: calls",
        f"calls: {calls}",
        f"call: {json.dumps(OPEN + chr(10))} %json {json.dumps(one)} {json.dumps(chr(10) + CLOSE)}",
    ]
    if mode == "auto":
        rules.append(_PLAIN_TEXT)
    return lark("\n".join(rules))


def _schema_of(value, param: str) -> dict | bool:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise bad_request(f"{param} is not valid JSON: {exc}", param) from None
    if not isinstance(value, (dict, bool)):
        raise bad_request(f"{param} must be a JSON schema (an object).", param)
    return value


def extra_constraints(fields: dict) -> list[tuple[str, Constraint]]:
    """vLLM's extra body fields, as (parameter name, constraint); None values are absent."""
    out = []
    so = fields.get("structured_outputs") or {}
    for key, value in so.items():
        if value is None or value is False:
            continue
        param = f"structured_outputs.{key}"
        match key:
            case "json":
                out.append((param, json_schema(_schema_of(value, param))))
            case "json_object":
                out.append((param, json_object()))
            case "regex":
                out.append((param, regex(value)))
            case "choice":
                out.append((param, choice(value)))
            case "grammar":
                out.append((param, lark(value)))
            case _:
                raise bad_request(
                    f"{param} is not supported (json, json_object, regex, choice, grammar).",
                    param,
                )
    makers = {
        "guided_json": lambda v: json_schema(_schema_of(v, "guided_json")),
        "guided_regex": regex,
        "guided_choice": choice,
        "guided_grammar": lark,
    }
    for key, make in makers.items():
        if fields.get(key) is not None:
            out.append((key, make(fields[key])))
    return out


def build(make, param: str) -> Constraint:
    """Make a constraint; a grammar that does not compile is a 400 naming `param`."""
    try:
        return make()
    except (ConstraintError, ValueError) as exc:
        raise bad_request(f"{param}: {exc}", param) from None


def checked(constraint: Constraint | None, tokenizer, vocab_size: int, param: str):
    """The constraint, compiled now (and cached) so that a bad grammar is a 400 before any
    request reaches the engine."""
    if constraint is None:
        return None
    try:
        start_constraint(constraint, tokenizer, vocab_size)
    except (ConstraintError, ValueError) as exc:
        raise bad_request(f"{param}: {exc}", param) from None
    return constraint


def one_constraint(candidates: list[tuple[str, Constraint]]) -> tuple[str, Constraint] | None:
    if len(candidates) > 1:
        names = ", ".join(p for p, _ in candidates)
        raise bad_request(
            f"give one structured-output constraint, not several ({names}).", candidates[1][0]
        )
    return candidates[0] if candidates else None


# ---------------------------------------------------------------- the two APIs


def format_constraints(req) -> list[tuple[str, Constraint]]:
    """OpenAI's response_format and vLLM's extra fields of a chat or text completion request."""
    out, rf = [], req.response_format
    if isinstance(rf, JsonSchemaFormat):
        schema = rf.json_schema.schema
        out.append(("response_format", build(lambda: json_schema(schema), "response_format")))
    elif isinstance(rf, JsonObjectFormat):
        out.append(("response_format", build(json_object, "response_format")))
    so = req.structured_outputs
    fields = {
        "structured_outputs": {k: getattr(so, k) for k in so.__struct_fields__} if so else None,
        **{
            k: getattr(req, k)
            for k in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
        },
    }
    try:
        out += extra_constraints(fields)
    except ValueError as exc:  # ConstraintError, or llguidance refusing a regex or grammar
        raise bad_request(str(exc), "structured_outputs") from None
    return out


def request_constraint(
    req,
    tokenizer,
    vocab_size: int,
    functions: dict[str, dict | None] | None = None,
    mode: str | None = None,
    name: str | None = None,
    parallel: bool = True,
) -> Constraint | None:
    """The one grammar of a request: its tool choice (mode "required" / "named" / "auto" over
    `functions`) or its response format, checked to compile. A forced tool choice leaves no room
    for another format; `auto` with a format is not supported."""
    formats = format_constraints(req) if req is not None else []
    found = one_constraint(formats)
    if functions and mode in ("required", "named"):
        constraint = build(lambda: tool_constraint(functions, mode, name, parallel), "tools")
        return checked(constraint, tokenizer, vocab_size, "tools")
    if functions and mode == "auto":
        if found is not None:
            raise bad_request(
                f"{found[0]} with tools needs tool_choice none, required or a named function.",
                found[0],
            )
        constraint = build(lambda: tool_constraint(functions, "auto", None, parallel), "tools")
        return checked(constraint, tokenizer, vocab_size, "tools")
    if found is None:
        return None
    return checked(found[1], tokenizer, vocab_size, found[0])
