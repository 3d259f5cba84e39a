"""The wire vocabulary, declared once at the bottom layer (no torch, no web framework): the
sampling parameters a request carries (`sampling.py`) and the typed `kv_transfer_params` with the
payloads a router builds for a prefill leg (`kv_params.py`). Engine, server, http, kv and router
speak these types."""
