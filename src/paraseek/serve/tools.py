"""Tool calls in DeepSeek's formats: the model's tool-call text parsed into OpenAI's `tool_calls`, whole or as
streamed deltas, and `tool_choice` turned into the grammar that forces a call (infer/structured.py).

The two syntaxes (both wrapped in <｜tool▁calls▁begin｜> ... <｜tool▁calls▁end｜>):
- v3 (DeepSeek-V3, R1, the R1-Distills): <｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>,
  calls separated by a newline;
- v31 (DeepSeek-V3.1): <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>, calls back to back.
Text before the block is the message's content (as vLLM's deepseek_v3 and deepseek_v31 parsers split it); text after
it is content too. The arguments are passed on as the model wrote them (a JSON string, not re-serialized).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from paraseek.infer.structured import TOOL_CALL_BEGIN, TOOL_CALL_END, TOOL_CALLS_BEGIN, TOOL_CALLS_END, TOOL_SEP


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    index: int
    id: str
    name: str = ""
    arguments: str = ""
    complete: bool = False

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolDelta:
    """What one feed() added to a call: its header (first delta: id and name) or more argument text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def as_openai(self) -> dict:
        d: dict = {"index": self.index}
        if self.id is not None:
            d.update(id=self.id, type="function")
        fn: dict = {"arguments": self.arguments}
        if self.name is not None:
            fn["name"] = self.name
        d["function"] = fn
        return d


@dataclass
class ToolCallParser:
    """feed(text) -> (content, [ToolDelta]) for each piece of the message's content as it streams; flush() at the
    end. Text that could be the start of a marker is held back until the next piece settles it. `calls` holds the
    calls so far; `malformed` says the block did not follow the syntax (the rest is then content)."""

    format: str = "v3"
    calls: list[ToolCall] = field(default_factory=list)
    malformed: bool = False
    _state: str = "content"  # content -> between -> header -> arguments -> between ... -> after
    _buf: str = ""

    @property
    def _arg_end(self) -> str:
        return f"\n```{TOOL_CALL_END}" if self.format == "v3" else TOOL_CALL_END

    def feed(self, text: str) -> tuple[str, list[ToolDelta]]:
        self._buf += text
        content, deltas = [], []
        while True:
            st, buf = self._state, self._buf
            if st in ("content", "after"):
                marker = TOOL_CALLS_BEGIN if st == "content" else None
                if marker is None:
                    content.append(buf)
                    self._buf = ""
                    break
                at = buf.find(marker)
                if at >= 0:
                    content.append(buf[:at])
                    self._buf, self._state = buf[at + len(marker):], "between"
                    continue
                keep = _partial_suffix(buf, marker)
                content.append(buf[:len(buf) - keep])
                self._buf = buf[len(buf) - keep:]
                break
            if st == "between":  # after the block's opening or a finished call: another call, or the block's end
                stripped = buf.lstrip("\n") if self.format == "v3" else buf
                if stripped.startswith(TOOL_CALL_BEGIN):
                    self._buf, self._state = stripped[len(TOOL_CALL_BEGIN):], "header"
                    continue
                if stripped.startswith(TOOL_CALLS_END):
                    self._buf, self._state = stripped[len(TOOL_CALLS_END):], "after"
                    continue
                if TOOL_CALL_BEGIN.startswith(stripped) or TOOL_CALLS_END.startswith(stripped):
                    break  # wait for more
                self._fail(content)
                continue
            if st == "header":
                if self.format == "v3":
                    sep, fence = buf.find(TOOL_SEP), buf.find("\n```json\n")
                    if sep < 0 or fence < 0:
                        if len(buf) > 512 or (sep < 0 and not _could_be(buf, "function")):
                            self._fail(content)
                            continue
                        break
                    name, rest = buf[sep + len(TOOL_SEP):fence], buf[fence + len("\n```json\n"):]
                else:
                    sep = buf.find(TOOL_SEP)
                    if sep < 0:
                        if len(buf) > 512:
                            self._fail(content)
                            continue
                        break
                    name, rest = buf[:sep], buf[sep + len(TOOL_SEP):]
                name = name.strip()
                if not name or any(c in name for c in "\n<"):
                    self._fail(content)
                    continue
                call = ToolCall(len(self.calls), call_id(), name)
                self.calls.append(call)
                deltas.append(ToolDelta(call.index, call.id, name, ""))
                self._buf, self._state = rest, "arguments"
                continue
            if st == "arguments":
                call, end = self.calls[-1], self._arg_end
                at = buf.find(end)
                if at >= 0:
                    piece, self._buf, self._state = buf[:at], buf[at + len(end):], "between"
                    call.complete = True
                else:
                    keep = _partial_suffix(buf, end)
                    piece, self._buf = buf[:len(buf) - keep], buf[len(buf) - keep:]
                if piece:
                    call.arguments += piece
                    if deltas and deltas[-1].index == call.index:
                        deltas[-1].arguments += piece
                    else:
                        deltas.append(ToolDelta(call.index, arguments=piece))
                if self._state == "arguments":
                    break
                continue
            break
        return "".join(content), deltas

    def flush(self) -> tuple[str, list[ToolDelta]]:
        """The end of the message: what was held back. An unfinished call stays as it is (the caller reports
        finish_reason length); held text outside a call is content."""
        content, deltas = self.feed("")
        if self._state in ("content", "after"):
            content, self._buf = content + self._buf, ""
        return content, deltas

    def _fail(self, content: list[str]) -> None:
        """Not the syntax after all: the marker and what follows are content, and parsing stops."""
        self.malformed = True
        content.append(TOOL_CALLS_BEGIN if not self.calls else "")
        self._state = "after"


def parse_tool_calls(text: str, fmt: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a whole message, as OpenAI's non-streamed response gives them. A block that does
    not parse, or a call that is cut off, leaves the whole text as content and no calls (vLLM's behaviour)."""
    p = ToolCallParser(fmt)
    content, _ = p.feed(text)
    rest, _ = p.flush()
    content += rest
    if p.malformed or not p.calls or not all(c.complete for c in p.calls):
        return text, []
    return content or None, [c.as_openai() for c in p.calls]


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper start of `marker`."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def _could_be(text: str, start: str) -> bool:
    return text.startswith(start) or start.startswith(text)


# ---- requests -----------------------------------------------------------------------------------------------------------
class ToolError(ValueError):
    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def check_tools(tools: list[dict] | None, tool_choice) -> list[dict]:
    """The functions of `tools` ([{name, description, parameters}]), checked; ToolError naming the field."""
    functions = []
    for i, t in enumerate(tools or []):
        if t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise ToolError(f"tools.{i}", 'each tool must be {"type": "function", "function": {"name": ...}}')
        fn = t["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not name or any(c in name for c in "\n<>`") or len(name) > 64:
            raise ToolError(f"tools.{i}.function.name", "a function name must be 1 to 64 characters without "
                            "newlines, '<', '>' or backticks")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ToolError(f"tools.{i}.function.parameters", "parameters must be a JSON schema object")
        if any(f["name"] == name for f in functions):
            raise ToolError(f"tools.{i}.function.name", f"two tools are named {name!r}")
        functions.append({"name": name, "parameters": params or {"type": "object", "properties": {}}})
    if tool_choice is not None and not functions and tool_choice != "none":
        raise ToolError("tool_choice", "tool_choice needs tools")
    if isinstance(tool_choice, str) and tool_choice not in ("none", "auto", "required"):
        raise ToolError("tool_choice", f"tool_choice must be none, auto, required or a named function, got "
                        f"{tool_choice!r}")
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name") if tool_choice.get("type") == "function" else None
        if not isinstance(name, str):
            raise ToolError("tool_choice", 'a named tool_choice is {"type": "function", "function": {"name": ...}}')
        if not any(f["name"] == name for f in functions):
            raise ToolError("tool_choice", f"tool_choice names {name!r}, which is not one of the tools")
    return functions


def forced_spec(functions: list[dict], tool_choice, fmt: str, parallel: bool) -> dict | None:
    """The grammar spec that forces a call for tool_choice required or a named function; None otherwise."""
    if tool_choice == "required":
        return {"type": "tool_calls", "format": fmt, "tools": functions, "parallel": parallel}
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        return {"type": "tool_calls", "format": fmt, "tools": [f for f in functions if f["name"] == name],
                "parallel": False}
    return None


def history_arguments(arguments) -> str:
    """A tool call's arguments in a request's history as the templates concatenate them: a JSON string (OpenAI's
    form), or an object serialized to one."""
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
