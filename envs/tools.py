"""The agent's tools (bash, str_replace_editor, submit), their JSON schemas, and the Hermes
`<tool_call>` parser. A malformed call is answered with an observation saying what was
wrong; nothing the model writes raises.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from typing import Any

TOOLS: list[dict] = [
    {"type": "function", "function": {
        "name": "bash", "description": "Run a command in a persistent bash shell in the repository.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                       "required": ["command"]}}},
    {"type": "function", "function": {
        "name": "str_replace_editor",
        "description": "View, create and edit files. view shows a file with line numbers or lists a "
                       "folder; str_replace needs old_str to occur exactly once; insert adds new_str "
                       "after line insert_line; undo_edit reverts the last edit of a file.",
        "parameters": {"type": "object", "properties": {
            "command": {"type": "string", "enum": ["view", "create", "str_replace", "insert", "undo_edit"]},
            "path": {"type": "string"}, "file_text": {"type": "string"}, "old_str": {"type": "string"},
            "new_str": {"type": "string"}, "insert_line": {"type": "integer"},
            "view_range": {"type": "array", "items": {"type": "integer"}}},
            "required": ["command", "path"]}}},
    {"type": "function", "function": {
        "name": "submit", "description": "Finish: your changes to the repository are the answer.",
        "parameters": {"type": "object", "properties": {}}}},
]  # fmt: skip

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass
class ParsedAction:
    call: ToolCall | None
    error: str | None = None
    error_at: int | None = None
    """Where in the text the call went wrong (a character offset) when the parser can tell: the
    JSON's first bad character, or the text's end for a call opened and never closed. None:
    well formed, or wrong as a whole (no call at all, not an object)."""


def parse_tool_call(text: str) -> ParsedAction:
    """The first Hermes/Qwen tool call in the model's text, or why there is none usable."""
    match = _TOOL_CALL.search(text)
    if match is None:
        return ParsedAction(None, "No tool call found. Call a tool with <tool_call>{\"name\": ..., "
                                  "\"arguments\": {...}}</tool_call>.",
                            len(text) if "<tool_call>" in text else None)
    try:
        data = json.loads(match.group(1))
    except json.JSONDecodeError as e:
        return ParsedAction(None, f"The tool call is not valid JSON ({e.msg} at char {e.pos}).", match.start(1) + e.pos)
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return ParsedAction(None, 'The tool call must be an object with a "name" string.')
    arguments = data.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            return ParsedAction(None, f"The tool call's arguments are not valid JSON ({e.msg}).")
    if not isinstance(arguments, dict):
        return ParsedAction(None, '"arguments" must be an object.')
    try:  # JSON can escape a lone surrogate, which no shell, file or tokenizer takes
        json.dumps([data["name"], arguments], ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return ParsedAction(None, "The tool call holds a lone surrogate (a \\ud800-\\udfff escape without "
                                  "its pair), which is not text.")
    return ParsedAction(ToolCall(data["name"], arguments))


def truncate_middle(text: str, limit: int) -> str:
    """Cut the middle of an over-long observation, saying how much was cut."""
    if len(text) <= limit:
        return text
    keep = max(0, limit - 80) // 2
    cut = len(text) - 2 * keep
    return f"{text[:keep]}\n[... {cut} characters cut from the middle ...]\n{text[len(text) - keep:]}"


@dataclass
class Editor:
    """str_replace_editor over a sandbox, with per-file undo history."""

    sandbox: Any
    workdir: str = "/work"
    max_view_bytes: int = 2 * 1024 * 1024
    history: dict[str, list[bytes | None]] = field(default_factory=dict)

    async def run(self, args: dict[str, Any]) -> str:
        command, path = args.get("command"), args.get("path")
        if command not in ("view", "create", "str_replace", "insert", "undo_edit"):
            return f"Unknown command {command!r}; use view, create, str_replace, insert or undo_edit."
        if not isinstance(path, str) or not path:
            return 'The "path" argument (a string) is required.'
        return await getattr(self, f"_{command}")(path, args)

    async def _exists(self, path: str) -> str:
        r = await self.sandbox.execute(f"if [ -d {shlex.quote(path)} ]; then echo dir; "
                                       f"elif [ -f {shlex.quote(path)} ]; then echo file; else echo none; fi")
        return r.output.strip()

    async def _read(self, path: str) -> bytes | str:
        try:
            return await self.sandbox.read_file(path)
        except FileNotFoundError:
            return f"The file {path} does not exist."

    async def _view(self, path: str, args: dict) -> str:
        kind = await self._exists(path)
        if kind == "dir":
            r = await self.sandbox.execute(f"find {shlex.quote(path)} -maxdepth 2 -not -path '*/.*' | sort | head -500")
            return f"Files and folders up to 2 levels deep in {path}:\n{r.output}"
        if kind == "none":
            return f"The path {path} does not exist."
        if args.get("view_range"):
            return await self._view_range(path, args["view_range"])
        size = await self.sandbox.execute(f"wc -c < {shlex.quote(path)}")
        if size.exit_code == 0 and int(size.output.strip() or 0) > self.max_view_bytes:
            return (f"{path} is {int(size.output)} bytes, too large to view whole; use view_range "
                    "or bash (grep, sed -n) to look at parts of it.")
        data = await self._read(path)
        if isinstance(data, str):
            return data
        if b"\0" in data[:8192]:
            return f"{path} is a binary file ({len(data)} bytes); it cannot be shown as text."
        lines = data.decode(errors="replace").split("\n")
        return "\n".join(f"{i:6}\t{line}" for i, line in enumerate(lines, 1))

    async def _view_range(self, path: str, view_range: Any) -> str:
        if (not isinstance(view_range, list) or len(view_range) != 2
                or not all(isinstance(v, int) for v in view_range)):
            return "view_range must be [start, end] line numbers (end -1 for the end of the file)."
        start, end = view_range
        end_expr = "$" if end == -1 else str(end)
        r = await self.sandbox.execute(f"sed -n '{max(1, start)},{end_expr}p' {shlex.quote(path)} | "
                                       f"awk -v s={max(1, start)} '{{printf \"%6d\\t%s\\n\", NR+s-1, $0}}'")
        return r.output

    async def _create(self, path: str, args: dict) -> str:
        text = args.get("file_text")
        if not isinstance(text, str):
            return 'create needs "file_text" (a string).'
        if await self._exists(path) != "none":
            return f"{path} already exists; use str_replace to edit it."
        self.history.setdefault(path, []).append(None)
        await self.sandbox.write_file(path, text)
        return f"Created {path}."

    async def _str_replace(self, path: str, args: dict) -> str:
        old, new = args.get("old_str"), args.get("new_str", "")
        if not isinstance(old, str) or not old:
            return 'str_replace needs a non-empty "old_str".'
        if not isinstance(new, str):
            return '"new_str" must be a string.'
        data = await self._read(path)
        if isinstance(data, str):
            return data
        text = data.decode(errors="replace")
        count = text.count(old)
        if count != 1:
            return (f"old_str occurs {count} times in {path}; it must occur exactly once. "
                    + ("Include more surrounding lines to make it unique." if count else "Check the text with view."))
        self.history.setdefault(path, []).append(data)
        await self.sandbox.write_file(path, text.replace(old, new))
        line = text[: text.index(old)].count("\n") + 1
        return f"Edited {path} at line {line}."

    async def _insert(self, path: str, args: dict) -> str:
        line, new = args.get("insert_line"), args.get("new_str")
        if not isinstance(line, int) or not isinstance(new, str):
            return 'insert needs "insert_line" (an integer) and "new_str" (a string).'
        data = await self._read(path)
        if isinstance(data, str):
            return data
        lines = data.decode(errors="replace").split("\n")
        if not 0 <= line <= len(lines):
            return f"insert_line must be between 0 and {len(lines)} for {path}."
        self.history.setdefault(path, []).append(data)
        lines[line:line] = new.split("\n")
        await self.sandbox.write_file(path, "\n".join(lines))
        return f"Inserted {len(new.splitlines()) or 1} line(s) after line {line} of {path}."

    async def _undo_edit(self, path: str, args: dict) -> str:
        if not self.history.get(path):
            return f"No edit of {path} to undo."
        previous = self.history[path].pop()
        if previous is None:
            await self.sandbox.execute(f"rm -f {shlex.quote(path)}")
            return f"Undid the creation of {path}."
        await self.sandbox.write_file(path, previous)
        return f"Reverted the last edit of {path}."
