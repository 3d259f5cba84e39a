"""One client request through the router, as data and small steps (runner.py has the sequence).

    context      Turn: the request, its id and arrival (frozen); the kv_stats and the time
                 spent waiting for workers that the steps fill in
    plan         TurnPlan, made by the pure plan_turn: what the turn replays, where its prefill
                 runs (placement.py), and each D leg's order (DecodeOrder)
    retry        RetryPolicy: which failure is retried where, how often, and when a turn falls
                 back from decode_local to P (no I/O)
    calls        WorkerCalls: one call to a worker, and what its failure does to the worker
                 (marked down, counted); Relayed, no_worker
    prefill      PrefillLeg: the P leg under the policy, with token_check.py (the router's
                 token check of a replay to a vLLM P, verify.py)
    decode       DecodeLeg: the D leg (JSON, or stream_leg.py for a relayed stream)
    migrate      Migration: a stream whose D broke, continued on another D from the prompt's
                 and the streamed tokens' ids
    runner       TurnRunner: recall -> plan -> legs -> remember

Every leg is counted in its worker's `outstanding` by backends.in_flight, which gives the count
back however the leg ends. The request bodies of both legs and the combined kv_stats are
legs.py's; the SSE rewriting is stream.py's; conversation state is router/conversation/'s.
"""
