"""OpenAI's Responses API (`POST /v1/responses`) on top of chat completions, shared by the worker
and the router: neither generates anything for it, both run the request as a chat turn.

    request.py   a Responses request -> a chat-completions body (input items -> messages,
                 instructions, flat function tools, tool_choice, text.format, ...); anything we
                 cannot honour is a 400 naming the field
    output.py    a chat completion (JSON) -> a Response object (reasoning, message and
                 function_call output items, usage, incomplete_details, the echoed request)
    events.py    a chat SSE stream -> the Responses streaming events, in OpenAI's order
    store.py     stored responses (`store`, `previous_response_id`, GET/DELETE by id): the
                 contract and the in-process store (bounded, expiring, namespaced by API key)
    front.py     one request end to end over a caller's chat runner (the worker's serving
                 path, the router's turn runner)
"""
