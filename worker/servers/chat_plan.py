"""A chat request on the worker: rendered with its tools through the model's template, constrained, parsed back.

The template that renders the tools is the one whose text names the call format (core.tool_calls.family_of),
so the grammar (core.tool_grammar) and the parser read the format the model was trained on; a template that renders
no tools gets the default tool prompt in the Hermes form (core.tool_prompt), its calls read as that family's. A
response_format beside the tools constrains the answer that is not calls. Rendered here, not
in the API: the API may not hold the model's files, and the worker's ids equal `apply_chat_template` by
construction, whatever Jinja extensions a template uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from core.protocol import ChatOptions, Constraint, ErrorCode, ErrorEvent, GenerateTask, SamplingParams
from core.tool_calls import (
    HERMES,
    THINK_CLOSE,
    THINK_OPEN,
    ChoiceParser,
    Family,
    family_of,
    template_messages,
    thinks,
)
from core.tool_grammar import MARKERS, constraint_rules, lark, tool_rules
from core.tool_prompt import plain_messages

if TYPE_CHECKING:
    from worker.engines.serving import ServingEngine


@dataclass(frozen=True)
class ChatPlan:
    """A rendered chat: its prompt ids, its sampling (the grammar in it), and how its answers are read back."""

    ids: list[int]
    params: SamplingParams
    family: Family | None  # set when the answer may hold calls
    think: str | None  # None, "open" (the model opens its thinking section) or "inside" (the prompt opened it)

    def parser(self) -> ChoiceParser | None:
        """One choice's parser, or None when the text is the content as it comes."""
        if self.family is None and self.think is None:
            return None
        return ChoiceParser(self.family, self.think is not None, in_think=self.think == "inside")


def _think_mode(engine: ServingEngine, template: str, ids: list[int]) -> str | None:
    if not thinks(template):
        return None
    tail = str(engine.tokenizer.decode(ids[-8:])).rstrip()
    if tail.endswith(THINK_OPEN):
        return "inside"
    if tail.endswith(THINK_CLOSE):  # enable_thinking false: the template wrote an empty thinking section
        return None
    return "open"


def plan_chat(engine: ServingEngine, task: GenerateTask) -> ChatPlan | ErrorEvent:
    """Render the task's chat with its tools; the params constrained to the family's calls and reasoning first."""
    from worker.engines.generation.sampling.grammar import field_of  # the engine (and torch) is loaded by now
    from worker.engines.generation.tokenizer import NoChatTemplate

    options = task.chat or ChatOptions()
    template = getattr(engine.tokenizer, "chat_template", None) or ""
    calls = bool(options.tools) and options.tool_choice != "none"
    native = family_of(template)
    # A template that renders no tools gets trainserve's default tool prompt, in the Hermes form (core/tool_prompt.py).
    family = (native or HERMES) if calls else None
    try:
        ids = _render(engine, task, options, generic=native is None, calls=calls)
    except NoChatTemplate as exc:
        return ErrorEvent.of(ErrorCode.VALIDATION_ERROR, str(exc), "model")
    except Exception as exc:  # noqa: BLE001 - a template's raise_exception (e.g. roles out of order) is the client's
        return ErrorEvent.of(ErrorCode.VALIDATION_ERROR, f"the chat template refused the messages: {exc}",
                             "messages")
    think = _think_mode(engine, template, ids) if ids else None
    params = task.params
    rules: list[str] | None = None
    token_ids = _marker_ids(engine.tokenizer)
    if family is not None:
        rules = tool_rules(family, options.tools or [], options.tool_choice, options.parallel_tool_calls, token_ids,
                           bounds=options.tool_bounds, answer=params.constraint)
    elif think is not None and params.constraint is not None:
        rules = constraint_rules(params.constraint)
    if rules is not None:
        grammar = lark(rules, think=think, token_ids=token_ids)
        field = "tools" if family is not None else field_of(params.constraint) if params.constraint else None
        params = params.model_copy(update={"constraint": Constraint(kind="lark", spec=grammar, field=field)})
    return ChatPlan(ids, params, family, think)


def _render(engine: ServingEngine, task: GenerateTask, options: ChatOptions, *, generic: bool, calls: bool
            ) -> list[int]:
    """The chat's prompt ids: through the template with its tools, or (`generic`) as plain messages with the default
    tool prompt when `calls` may be made."""
    from worker.engines.generation.tokenizer import NoChatTemplate

    messages = template_messages([m.model_dump(exclude_none=True) for m in task.messages or []])
    if not generic:
        return list(engine.encode_chat(messages, options.tools, **options.template_kwargs))
    tools = options.tools if calls else None
    try:
        return list(engine.encode_chat(plain_messages(messages, tools), None, **options.template_kwargs))
    except NoChatTemplate:
        raise
    except Exception:
        if not tools:
            raise
        # A template that refuses a system message (Gemma's): the tools' text opens the first user message instead.
        return list(engine.encode_chat(plain_messages(messages, tools, system_role=False), None,
                                       **options.template_kwargs))


def _marker_ids(tokenizer: Any) -> dict[str, int]:
    """The call and thinking markers the tokenizer holds as added tokens (llguidance sees those as special)."""
    added = tokenizer.get_added_vocab()
    return {marker: added[marker] for marker in MARKERS if marker in added}
