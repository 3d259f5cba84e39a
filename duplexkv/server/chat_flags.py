"""The worker's chat-output flags, named as vLLM's:

    --enable-auto-tool-choice    tool_choice "auto" (the default with tools): parse tool calls
    --tool-call-parser hermes    ... in this format (server/tool_parser.py); needed by the above
    --reasoning-parser NAME      qwen3 | deepseek_r1: `<think>` text into `reasoning`

Kept apart from server/serve.py so that these imports stay light (no torch) for `--help`.
"""

from __future__ import annotations

import argparse

from duplexkv.server.chat_output import ChatParsing
from duplexkv.server.reasoning import PARSERS as REASONING_PARSERS
from duplexkv.server.tool_parser import PARSERS as TOOL_PARSERS


FLAGS: dict[str, dict] = {
    "--enable-auto-tool-choice": {
        "action": "store_true",
        "help": "honour tool_choice \"auto\" (the default when a request has tools): tool calls "
                "are parsed out of the model's text; needs --tool-call-parser"},
    "--tool-call-parser": {
        "choices": TOOL_PARSERS, "default": None,
        "help": "the format of the model's tool calls: hermes = Hermes/Qwen "
                "<tool_call>{json}</tool_call>"},
    "--reasoning-parser": {
        "choices": REASONING_PARSERS, "default": None,
        "help": "put the model's <think>...</think> text in the `reasoning` field of chat "
                "answers and deltas (vLLM's name)"},
}


def add_chat_parsing_args(p: argparse.ArgumentParser) -> None:
    for flag, spec in FLAGS.items():
        p.add_argument(flag, **spec)


def chat_parsing(args: argparse.Namespace) -> ChatParsing:
    """ValueError for flags that do not go together (one CLI error line, as vLLM refuses them)."""
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (e.g. hermes)")
    return ChatParsing(args.tool_call_parser if args.enable_auto_tool_choice else None,
                       args.reasoning_parser)


__all__ = ["add_chat_parsing_args", "chat_parsing"]
