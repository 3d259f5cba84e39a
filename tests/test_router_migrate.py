"""The continuation request and chunks of a migrated stream (duplexkv/router/turn/migrate.py)."""

from duplexkv.router.turn.migrate import (
    as_client_chunk,
    continuation_body,
    default_limit,
    migratable,
)


def test_continuation_takes_the_sent_tokens_off_the_limits():
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 10,
            "min_tokens": 4, "temperature": 0, "stream": True, "conversation_id": "c",
            "stream_options": {"include_usage": True}, "return_token_ids": False}
    out = continuation_body(body, [1, 2, 3, 7, 8], sent=2)
    assert out == {"model": "m", "temperature": 0, "prompt": [1, 2, 3, 7, 8], "max_tokens": 8,
                   "min_tokens": 2, "stream": True, "return_token_ids": True,
                   "stream_options": {"include_usage": True}}
    assert continuation_body({**body, "max_completion_tokens": 2}, [1], sent=2) is None


def test_only_single_choice_streams_without_logprobs_or_tools_migrate():
    assert migratable({"messages": []})
    assert not migratable({"n": 2}) and not migratable({"logprobs": True})
    assert not migratable({"tools": [{"type": "function"}]})


def test_a_continuation_chunk_takes_the_clients_shape():
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 5, "model": "m"}
    chunk = {"id": "cmpl-9", "object": "text_completion", "created": 6, "model": "m",
             "choices": [{"index": 0, "text": " next", "finish_reason": None, "token_ids": [4]}],
             "kv_transfer_params": {"x": 1}}
    out = as_client_chunk(chunk, head, chat=True, prompt=5, sent=2)
    assert out == {**head, "choices": [{"index": 0, "delta": {"content": " next"},
                                        "finish_reason": None, "token_ids": [4]}]}
    usage = {"prompt_tokens": 7, "completion_tokens": 8, "total_tokens": 15}
    out = as_client_chunk({"choices": [], "usage": usage}, {**head, "object": "text_completion"},
                          chat=False, prompt=5, sent=2)
    assert out["usage"] == {"prompt_tokens": 5, "completion_tokens": 10, "total_tokens": 15}


def test_a_chat_without_max_tokens_is_continued_to_the_end_of_the_context():
    """A chat names no max_tokens: the continuation (a completion, whose default is 16 since
    completions default as vLLM's) is given the rest of the D's context, not 16 tokens."""
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}
    prompt, sent = [5] * 100, [6] * 30
    out = continuation_body(chat, prompt + sent, len(sent),
                            default_limit(True, 4096, len(prompt)))
    assert out["max_tokens"] == 4096 - 100 - 30
    assert default_limit(False, 4096, 100) == 16  # a completion's own default
    assert default_limit(True, None, 100) is None  # unknown length: the worker's default
