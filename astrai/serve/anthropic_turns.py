"""An Anthropic conversation -> the template messages the OpenAI side builds too, so one chat
template serves both APIs: tool_use blocks become assistant tool calls, tool_result blocks
become tool turns, and a last assistant turn starts the answer."""

from __future__ import annotations

from astrai.serve import tools
from astrai.serve.errors import bad_request
from astrai.serve.schemas_anthropic import (
    CountTokensRequest,
    MessagesRequest,
    TextBlock,
    ToolChoiceNone,
    ToolChoiceTool,
    ToolResultBlock,
    ToolUseBlock,
)


def joined_text(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "\n".join(b.text for b in content)


def tool_result_turn(block: ToolResultBlock) -> dict:
    text = joined_text(block.content)
    return {
        "role": "tool",
        "tool_call_id": block.tool_use_id,
        "content": f"Error: {text}" if block.is_error else text,
    }


def user_turns(blocks: list, where: str) -> list[dict]:
    """Tool results come first as tool turns, then the user's text (if any) as one turn."""
    if any(isinstance(b, ToolUseBlock) for b in blocks):
        raise bad_request(f"{where}: tool_use blocks belong in assistant messages.", where)
    turns = [tool_result_turn(b) for b in blocks if isinstance(b, ToolResultBlock)]
    texts = [b.text for b in blocks if isinstance(b, TextBlock)]
    return turns + ([{"role": "user", "content": "\n".join(texts)}] if texts or not turns else [])


def assistant_turn(blocks: list, where: str) -> dict:
    if any(isinstance(b, ToolResultBlock) for b in blocks):
        raise bad_request(f"{where}: tool_result blocks belong in user messages.", where)
    turn = {
        "role": "assistant",
        "content": "".join(b.text for b in blocks if isinstance(b, TextBlock)),
    }
    calls = [
        {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
        for b in blocks
        if isinstance(b, ToolUseBlock)
    ]
    return {**turn, "tool_calls": calls} if calls else turn


def template_messages(req: MessagesRequest | CountTokensRequest) -> list[dict]:
    turns = [] if req.system is None else [{"role": "system", "content": joined_text(req.system)}]
    for k, message in enumerate(req.messages):
        content = message.content
        if isinstance(content, str):
            turns.append({"role": message.role, "content": content})
        elif message.role == "assistant":
            turns.append(assistant_turn(content, f"messages[{k}].content"))
        else:
            turns += user_turns(content, f"messages[{k}].content")
    return turns


def message_tools(req: MessagesRequest | CountTokensRequest) -> list[dict] | None:
    """The tools for the template; none with tool_choice none."""
    choice = req.tool_choice
    if not req.tools or isinstance(choice, ToolChoiceNone):
        return None
    if isinstance(choice, ToolChoiceTool):
        names = [t.name for t in req.tools]
        if choice.name not in names:
            raise bad_request(
                f"tool_choice.name: `{choice.name}` is not among tools {names}.", "tool_choice"
            )
    return [tools.tool_spec(t.name, t.description, t.input_schema) for t in req.tools]


def split_prefill(turns: list[dict]) -> tuple[list[dict], str]:
    """A conversation that ends in an assistant turn asks for that turn to be continued: its
    text starts the answer (and, as in Anthropic's API, is not repeated in the response)."""
    last = turns[-1]
    if last["role"] == "assistant" and "tool_calls" not in last:
        return turns[:-1], last["content"]
    return turns, ""
