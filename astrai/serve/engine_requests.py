"""Either API's request -> the engine requests it makes: prompt ids and `SamplingParams` each
(the grammar the answer must follow travels in them as `constraint`), checked against the
server's limits on the way.

What a client leaves out keeps the engine's default. n choices of one prompt are n engine
requests, seeded seed, seed+1, ... when a seed is given, so that they differ.
"""

from __future__ import annotations

import msgspec

from astrai.infer import Constraint
from astrai.infer.sampling import SamplingParams
from astrai.serve import structured, tools
from astrai.serve.anthropic_turns import message_tools, split_prefill, template_messages
from astrai.serve.chat import chat_prompt, check_token_ids, prompt_ids
from astrai.serve.errors import bad_request
from astrai.serve.schemas_anthropic import (
    CountTokensRequest,
    MessagesRequest,
    ToolChoiceAny,
    ToolChoiceNone,
    ToolChoiceTool,
)
from astrai.serve.schemas_openai import (
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    NamedToolChoice,
    SamplingFields,
)
from astrai.serve.state import AppState, check_generates, check_model, token_budget

# The legacy completions API generates 16 tokens when max_tokens is not given.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


class EngineRequest(msgspec.Struct, frozen=True):
    prompt: list[int]
    sampling: SamplingParams
    adapter: str | None = None  # the LoRA adapter to answer with; None: the base model


class Generation(msgspec.Struct, frozen=True):
    """The engine requests of one HTTP request (one per choice), and whether the answers are
    read for tool calls."""

    requests: list[EngineRequest]
    parse_tools: bool = False


def checked_sampling(**fields) -> SamplingParams:
    """SamplingParams of the fields given (None keeps the default); a value the engine does not
    take is a 400."""
    try:
        return SamplingParams(**{k: v for k, v in fields.items() if v is not None})
    except ValueError as exc:
        raise bad_request(f"bad sampling argument: {exc}") from None


def per_choice(params: SamplingParams, n: int) -> list[SamplingParams]:
    if params.seed is None:
        return [params] * n
    return [msgspec.structs.replace(params, seed=params.seed + i) for i in range(n)]


def check_generation(state: AppState, model: str) -> str | None:
    """What every generation route checks first: the model is served and it generates.
    -> the adapter `model` names (None: the base model)."""
    adapter = check_model(state, model)
    check_generates(state)
    return adapter


# ---------------------------------------------------------------- OpenAI


def stop_list(stop: str | list[str] | None) -> list[str] | None:
    stops = [stop] if isinstance(stop, str) else stop or []
    return [s for s in stops if s] or None


def openai_sampling(
    req: SamplingFields, max_tokens: int, top_logprobs: int | None, constraint: Constraint | None
) -> SamplingParams:
    return checked_sampling(
        max_tokens=max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k if req.top_k and req.top_k > 0 else None,  # -1 and 0: no top-k
        min_p=req.min_p,
        repetition_penalty=req.repetition_penalty,
        frequency_penalty=req.frequency_penalty,
        presence_penalty=req.presence_penalty,
        logit_bias=req.logit_bias or None,
        seed=req.seed,
        stop=stop_list(req.stop),
        logprobs=top_logprobs is not None or None,
        top_logprobs=top_logprobs or None,
        constraint=constraint,
        ignore_eos=req.ignore_eos or None,
    )


def check_openai_limits(
    state: AppState, req: SamplingFields, top_logprobs: int | None
) -> str | None:
    """-> the adapter the request's model names (None: the base model)."""
    adapter = check_generation(state, req.model)
    cfg = state.serve_cfg
    if req.n > cfg.max_n:
        raise bad_request(f"n is {req.n}; this server allows at most {cfg.max_n}.", "n")
    if top_logprobs is not None and top_logprobs > cfg.max_top_logprobs:
        raise bad_request(
            f"top_logprobs is {top_logprobs}; at most {cfg.max_top_logprobs} is allowed.",
            "top_logprobs",
        )
    if req.logit_bias:
        check_token_ids(req.logit_bias, state.vocab_size, "logit_bias")
    return adapter


def template_message(message: ChatMessage) -> dict:
    data = msgspec.to_builtins(message)
    if data["role"] == "developer":  # OpenAI's newer name for the system turn
        data["role"] = "system"
    return data


def chat_tools(state: AppState, req: ChatRequest) -> tuple[list[dict] | None, Constraint | None]:
    """(tools for the template, the grammar of the answer); no tools at all with tool_choice
    none. A required or named tool choice makes the answer a call whose arguments follow the
    function's parameters; auto lets it be text or calls."""
    if not req.tools or req.tool_choice == "none":
        return None, structured.request_constraint(req, state.tokenizer, state.vocab_size)
    specs = [
        tools.tool_spec(t.function.name, t.function.description, t.function.parameters)
        for t in req.tools
    ]
    functions = {t.function.name: t.function.parameters for t in req.tools}
    choice, name = req.tool_choice, None
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in functions:
            raise bad_request(
                f"tool_choice names `{name}`, which is not among tools {list(functions)}.",
                "tool_choice",
            )
    mode = "named" if name else "required" if choice == "required" else "auto"
    parallel = req.parallel_tool_calls is not False
    constraint = structured.request_constraint(
        req, state.tokenizer, state.vocab_size, functions, mode, name, parallel
    )
    return specs, constraint


def chat_generation(state: AppState, req: ChatRequest, top_logprobs: int | None) -> Generation:
    adapter = check_openai_limits(state, req, top_logprobs)
    specs, constraint = chat_tools(state, req)
    messages = [template_message(m) for m in req.messages]
    prompt = chat_prompt(state.tokenizer, messages, specs)
    requested = req.max_completion_tokens or req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
    budget = token_budget(
        len(prompt), requested, state.context, state.serve_cfg.default_max_tokens, param, "messages"
    )
    params = openai_sampling(req, budget, top_logprobs, constraint)
    requests = [EngineRequest(prompt, p, adapter) for p in per_choice(params, req.n)]
    return Generation(requests, specs is not None)


def completion_prompts(state: AppState, req: CompletionRequest) -> list[list[int]]:
    """The request's prompts as token ids, checked: n choices of each within max_n."""
    check_openai_limits(state, req, req.logprobs)
    prompts = prompt_ids(state.tokenizer, req.prompt, state.vocab_size, "prompt")
    if len(prompts) * req.n > state.serve_cfg.max_n:
        raise bad_request(
            f"{len(prompts)} prompts x n={req.n} choices is more than this server's "
            f"{state.serve_cfg.max_n} choices per request.",
            "n",
        )
    return prompts


def completion_generation(
    state: AppState, req: CompletionRequest, prompts: list[list[int]]
) -> Generation:
    """n engine requests per prompt, choice `prompt * n + k` of the response."""
    adapter = check_model(state, req.model)
    constraint = structured.request_constraint(req, state.tokenizer, state.vocab_size)
    requests = []
    for ids in prompts:
        budget = token_budget(
            len(ids), req.max_tokens, state.context, COMPLETIONS_DEFAULT_MAX_TOKENS,
            "max_tokens", "prompt",
        )  # fmt: skip
        params = openai_sampling(req, budget, req.logprobs, constraint)
        requests += [EngineRequest(ids, p, adapter) for p in per_choice(params, req.n)]
    return Generation(requests)


# ---------------------------------------------------------------- Anthropic


def message_prompt(state: AppState, req: MessagesRequest | CountTokensRequest):
    """-> (prompt ids, whether tools are in play)."""
    specs = message_tools(req)
    turns, prefill = split_prefill(template_messages(req))
    return chat_prompt(state.tokenizer, turns, specs, prefill), specs is not None


def tool_grammar(state: AppState, req: MessagesRequest) -> Constraint | None:
    """The answer's grammar: `any` forces calls of any tool, `tool` a call of that one (its
    input following the tool's input_schema), `auto` text or calls."""
    choice = req.tool_choice
    if not req.tools or isinstance(choice, ToolChoiceNone):
        return None
    functions = {t.name: t.input_schema for t in req.tools}
    named = isinstance(choice, ToolChoiceTool)
    mode = "named" if named else "required" if isinstance(choice, ToolChoiceAny) else "auto"
    parallel = not (choice is not None and choice.disable_parallel_tool_use)
    return structured.request_constraint(
        None, state.tokenizer, state.vocab_size, functions, mode,
        choice.name if named else None, parallel,
    )  # fmt: skip


def message_generation(state: AppState, req: MessagesRequest) -> Generation:
    adapter = check_generation(state, req.model)
    prompt, with_tools = message_prompt(state, req)
    constraint = tool_grammar(state, req)
    budget = token_budget(len(prompt), req.max_tokens, state.context, 0, "max_tokens", "messages")
    params = checked_sampling(
        max_tokens=budget,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k or None,
        stop=[s for s in req.stop_sequences or () if s] or None,
        constraint=constraint,
    )
    return Generation([EngineRequest(prompt, params, adapter)], with_tools)
