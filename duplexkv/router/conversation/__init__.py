"""Conversation state on the router: what a conversation's last turn left on its D, and for how
long D keeps it.

    store      ConversationStore (memory, or Redis behind a breaker): conversation -> the Entry
               of its last turn (D's `kv_transfer_params`, D's URL, D's tokens when learned);
               single use (`take`), bounded, expiring before D's TTL; keys namespaced by the
               router API key (`conversation_key`)
    breaker    the circuit breaker that keeps a hung or dead Redis off the request path
    recall     Conversations: a turn's `recall` (the entry it replays, and its state: hit, miss,
               expired, invalidated, not_retained) and `remember` (what D kept, for the next turn)
    recognise  a chat request without an id: the prefix keys of its canonical messages
               (namespaced by API key and model), looked up newest first; its answer's key
    answer     the assistant message D produced, from its JSON answer or its stream
    lifecycle  LeaseKeeper: the active conversations whose leases on D the router renews, and the
               entries D has released (never handed out again)
    routes     POST /v1/conversations/{id}/keepalive and DELETE /v1/conversations/{id}

A turn (router/turn/) reads this state once at its start (`Recalled`) and writes it once at its
end; nothing here calls a worker's generation endpoints.
"""
