"""Disaggregated prefill and decode (``radixserve serve --disaggregate P:D``, docs/scaling.md).

Prefill engine processes compute prompts; decode engine processes hold the requests and generate. A
decode engine keeps what its own radix tree already holds and receives only the rest of a prompt's KV,
page by page, from a prefill engine: a follow-up chat turn moves only its new tokens.

- ``transfer.py``: the transfer record (a header with the layout fingerprint and a checksum, then
  the pool's page byte records) and its verification;
- ``transport.py``: how records travel: shared memory on one host, ZMQ over TCP across hosts;
- ``prefill.py``, ``decode.py``: the two roles, run inside the engine process's loop;
- ``coordinator.py``: the API server's side: picks a decode and a prefill engine per request, retries a
  prefill whose engine died, and counts what moved (``metrics.py``).
"""
