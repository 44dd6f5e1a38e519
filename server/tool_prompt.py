"""Tools and tool turns into the chat template's messages.

A template with a tool section (one that reads `tools`, as Qwen2.5's, Hermes's and
Llama 3.1's do) gets the tools and the conversation as transformers expects them: an
assistant turn's `tool_calls` with their arguments as objects, and `role: "tool"` turns
with their `tool_call_id`. A template without one (the embedded SmolLM2's) gets the
fallback below, in the Hermes convention the output parser reads (server/tool_calls.py):
the tools described in the system message, the assistant's earlier calls written as
`<tool_call>` blocks, and tool results handed back in a user turn as `<tool_response>`
blocks.
"""

from __future__ import annotations

import json

from server.tool_calls import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

FALLBACK_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def template_has_tools(chat_template: str | None) -> bool:
    return chat_template is not None and "tools" in chat_template


def openai_tools(functions: list[dict]) -> list[dict]:
    return [{"type": "function", "function": f} for f in functions]


def native_messages(messages: list[dict]) -> list[dict]:
    """Messages for a template with a tool section: call arguments as objects, as
    transformers' templates expect (they `tojson` them)."""
    rendered = []
    for message in messages:
        message = dict(message)
        if message.get("tool_calls"):
            message["tool_calls"] = [{**call, "function": {**call["function"],
                                                           "arguments": _arguments(call["function"]["arguments"])}}
                                     for call in message["tool_calls"]]
        rendered.append(message)
    return rendered


def fallback_messages(messages: list[dict], functions: list[dict] | None) -> list[dict]:
    """Messages for a template without a tool section, every turn plain text."""
    rendered: list[dict] = []
    previous_role = None
    for message in messages:
        role = message["role"]
        if role == "assistant" and message.get("tool_calls"):
            calls = [f"{TOOL_CALL_OPEN}\n"
                     + json.dumps({"name": c["function"]["name"], "arguments": _arguments(c["function"]["arguments"])},
                                  ensure_ascii=False)
                     + f"\n{TOOL_CALL_CLOSE}" for c in message["tool_calls"]]
            text = "\n".join(([message["content"]] if message.get("content") else []) + calls)
            rendered.append({"role": "assistant", "content": text})
        elif role == "tool":
            response = f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"
            if previous_role == "tool":
                rendered[-1]["content"] += "\n" + response  # several results answer one turn of calls
            else:
                rendered.append({"role": "user", "content": response})
        else:
            rendered.append({"role": role, "content": message.get("content") or "",
                             **({"name": message["name"]} if "name" in message else {})})
        previous_role = role
    if functions:
        preamble = FALLBACK_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False)
                                                          for t in openai_tools(functions)))
        if rendered and rendered[0]["role"] == "system":
            rendered[0]["content"] = f"{rendered[0]['content']}\n\n{preamble}"
        else:
            rendered.insert(0, {"role": "system", "content": preamble})
    return rendered


def _arguments(arguments: str):
    try:
        return json.loads(arguments)
    except (ValueError, RecursionError):  # kept as written, as other text that is not JSON
        return arguments
