"""Worker discovery through Redis: workers join and leave without restarting routers.

    worker  `duplexkv serve ... --discovery redis://... --discovery-role decode`
            registrar: SET duplexkv:workers:<id> <registration> PX 3h + ZADD the id to
            duplexkv:workers:index every heartbeat h, DEL + ZREM on a clean shutdown; Redis down
            = log, retry with backoff, keep serving
    router  `duplexkv router --discovery redis://...` (with or without --prefill/--decode)
            watcher: every poll (h/2 by default) read the index, MGET the keys, check each record
            (shape, signature when a secret is set, key = id), and hand the snapshot to the
            router's membership (duplexkv/router/membership.py), which adds and removes workers

Modules: record (the registration, its key, signature and the Redis URL's redacted form),
registrar (the worker's heartbeat), watcher (the router's poll). Nothing here imports torch, the
engine or a web framework: the worker (server) and the router both use it.
"""
