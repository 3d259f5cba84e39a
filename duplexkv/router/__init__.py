"""The KV-cache-aware P/D router: `duplexkv router --prefill URL... --decode URL... --port N`.

One turn of a conversation (`conversation_id` in the body, or `X-Session-ID` /
`X-Conversation-ID`), as the router runs it:

    client           router                         P worker              D worker
      | POST turn N    |                                |                     |
      |--------------->| take(api key, conv id): D's    |                     |
      |                | params of turn N-1, single use |                     |
      |                | (none on turn 1: miss payload) |                     |
      |                | P leg: max_tokens=1,           |                     |
      |                | stream=false, + D's params --->| verify + READ D's   |
      |                | (booleans forced)              | blocks (D->P) <---->| turn N-1, retained
      |                |                                | prefill the rest,   |
      |                |<----- P's params + kv_stats ---| lease its blocks    |
      |                | D leg: body + P's params ------------------------->| READ P's blocks
      |                | (prefer turn N-1's D: its prefix cache holds the   | (P->D; only what
      |                |  history, so only the new tail moves)              | its cache lacks)
      |<== SSE chunk ==|<==================== token stream ==================| decode
      | (one event at  | take D's params off the final chunk, put(conv);    | keep prompt+answer
      |  a time)       | kv_stats = P leg + D leg + router timings          | (decoder TTL)

Modules: config (RouterConfig), request (client request, validation, conversation id, tenant),
turn/ (one turn as a pure plan and small steps: plan, retry policy, P and D legs, runner),
conversation/ (conversation state: the store (memory, Redis), recall/remember, the lease keeper,
the keepalive and delete endpoints), backends (pool, choice, in-flight counts), health (health
checks), placement (decode_local or P), legs (request rewriting, combined kv_stats), stream (SSE
rewriting), verify (the token check for vLLM P), warmup (vLLM pairs' cold start), upstream +
http_client (the HTTP client to the workers), discovery + membership (workers joining and
leaving through the Redis registry, --discovery), metrics, app (HTTP endpoints), serve (the CLI
command). Nothing here imports torch.
"""
