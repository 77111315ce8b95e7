"""Model output after the tool-call marker -> OpenAI `tool_calls` (parsing is qnpipe.chat.tools.parse_reply).

Nothing the model wrote is lost: text between the blocks, and blocks that are not valid
calls, stay in the message's content as written.
"""

from __future__ import annotations

import json
import secrets

from qnpipe.chat.tools import CLOSE, OPEN, parse_reply
from qnpipe.server.schemas import FunctionCall, OutToolCall

MARKER = OPEN


def split_tool_calls(text: str) -> tuple[list[OutToolCall], str]:
    """The valid calls in `text` (output from its first MARKER on) and the rest of it, as content."""
    reply = parse_reply(text)
    calls = [OutToolCall(id=f"call_{secrets.token_hex(12)}",
                         # the template renders the arguments back as sent: json.dumps's form, as it wrote them
                         function=FunctionCall(name=c.name, arguments=json.dumps(c.arguments, ensure_ascii=False)))
             for c in reply.tool_calls]
    if not calls:
        return [], text
    rest = reply.content
    for bad in reply.malformed:
        closed = not bad.error.startswith(f"{OPEN} not closed")
        rest += f"{OPEN}{bad.text}{CLOSE if closed else ''}"
    return calls, rest
