"""Tool calls on chat completions (`tools`, `tool_choice`), for models whose chat template
renders the tools and writes calls in a format read here: DeepSeek-V3's, whose template
marks a call with its special tokens

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    ARGUMENTS
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

tool_choice "auto" (the default with tools): the reply is decoded as any other and the calls
in it, if any, are parsed out into `tool_calls` (finish_reason "tool_calls"). A named tool:
the prompt ends with the call's opening, through "```json\\n", and the reply is guided
(structured.py) to the tool's parameters schema, so that it always parses. "required": the
prompt ends before the name, and the reply is guided to one of the tools' names, then to that
tool's parameters. "none": the tools are rendered and the reply is plain text. A model whose template
does not render tools, or writes calls in a format not read here, gets a 400 that says so.
"""

import json
import re
import secrets

import jinja2.meta

from serving.openai_api import APIError
from serving.structured import compile_schema

CALLS_BEGIN, CALL_BEGIN, SEP, CALL_END, CALLS_END = ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>",
                                                    "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>")
ARGS_OPEN, ARGS_CLOSE = "\n```json\n", "\n```"
CALL_PATTERN = re.compile(re.escape(CALL_BEGIN) + r"(?P<type>.*?)" + re.escape(SEP) + r"(?P<name>.*?)" + re.escape(ARGS_OPEN)
                          + r"(?P<arguments>.*?)" + re.escape(ARGS_CLOSE) + re.escape(CALL_END), re.DOTALL)


def renders_tools(chat):
    """Whether the chat template reads `tools` and writes calls in DeepSeek-V3's format."""
    template_reads = jinja2.meta.find_undeclared_variables(chat.compiled.environment.parse(chat.template))
    return "tools" in template_reads and all(marker in chat.specials for marker in (CALLS_BEGIN, CALL_BEGIN, SEP, CALL_END))


def check_tools(tools, tool_choice, chat):
    """(tools, the names one of which a call is forced to, or None, whether to parse calls) of a request, or a 400
    naming what is wrong."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return None, None, False
    if not renders_tools(chat):
        raise APIError(400, f"tools: the chat template of {chat.source} does not render tools in a format read here "
                       "(DeepSeek-V3's): send the tools in a message instead", param="tools")
    names = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type") != "function" or not isinstance(function.get("name"), str):
            raise APIError(400, f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., "parameters": {{...}}}}}}',
                           param="tools")
        names.append(function["name"])
    if len(set(names)) < len(names) or any("\n" in name for name in names):
        raise APIError(400, "tools: each tool needs a name of its own, on one line", param="tools")
    if tool_choice in (None, "auto"):
        return tools, None, True
    if tool_choice == "none":
        return tools, None, False
    if tool_choice == "required":
        return tools, names, True
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if name not in names:
        raise APIError(400, f"tool_choice must be none, auto, required or {{\"type\": \"function\", \"function\": {{\"name\": "
                       f"...}}}} naming one of the tools ({', '.join(names)}), got {json.dumps(tool_choice)}", param="tool_choice")
    return tools, [name], True


def forced_node(tools, names):
    """The structured.py node a forced call is guided by: one tool's parameters schema, or of several, a name
    (with the arguments' opening) and then that tool's; SchemaRefused naming the tool whose schema is not read."""
    schemas = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object", "properties": {}} for t in tools}
    nodes = {name: compile_schema(schemas[name], f"{name}'s parameters") for name in names}
    if len(names) == 1:
        return nodes[names[0]]
    return ("switch", tuple(((name + ARGS_OPEN).encode(), nodes[name]) for name in names))


def call_opening(names):
    """What the prompt ends with when a call is forced: the call up to its arguments (one tool), or up to its name."""
    return CALLS_BEGIN + CALL_BEGIN + "function" + SEP + (names[0] + ARGS_OPEN if len(names) == 1 else "")


def forced_calls(names, text):
    """The tool_calls of a forced call's reply: its arguments (one tool), or its name, the opening and its arguments."""
    if len(names) == 1:
        return [tool_call(names[0], text)]
    name, _, arguments = text.partition(ARGS_OPEN)
    return [tool_call(name, arguments)]


def tool_call(name, arguments):
    return dict(id=f"call_{secrets.token_hex(12)}", type="function", function=dict(name=name, arguments=arguments))


def parse_calls(text):
    """(content before the calls or None, [tool_call]) of a reply's text with its special tokens shown."""
    calls = [tool_call(m["name"].strip(), m["arguments"].strip()) for m in CALL_PATTERN.finditer(text)]
    if not calls:
        return text, []
    content = text.split(CALLS_BEGIN)[0].split(CALL_BEGIN)[0]
    return content or None, calls
