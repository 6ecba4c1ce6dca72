"""A disaggregated engine process: the engine process (runtime/engine_process.py) with a prefill or a
decode role on its loop.

Its command is ``python -m radixserve.disagg.process --role decode --kv-transport shm ...`` followed by
the engine process's own flags; the API server's side builds it with ``role_command`` and hands it to
``AsyncEngine(process_args=...)``. The role's flags are parsed here and the rest goes to
``engine_process.main``, which builds the loop with the role this module makes: the engine process
never names a role, so ``server`` does not import ``disagg``.
"""

from __future__ import annotations

import argparse
import dataclasses

from radixserve.disagg.decode import DEFAULT_TIMEOUT_S, DecodeRole
from radixserve.disagg.prefill import PrefillRole
from radixserve.disagg.transport import TRANSPORTS, KVReceiver, KVSender
from radixserve.runtime import engine_process
from radixserve.runtime.engine_loop import EngineLoop, EngineRole

ROLES = ("prefill", "decode")
MODULE = "radixserve.disagg.process"  # this module (``__name__`` is "__main__" when it runs)


@dataclasses.dataclass(frozen=True)
class RoleOptions:
    """A disaggregated engine's role and how its KV pages travel."""

    role: str  # "prefill" | "decode"
    transport: str = "shm"  # "shm" (one host) | "tcp" (across hosts)
    host: str = "127.0.0.1"  # the decode engine's transfer address, with tcp
    timeout_s: float = DEFAULT_TIMEOUT_S  # a decode engine's reservation waits this long for its next chunk

    def build(self, loop: EngineLoop) -> EngineRole:
        """The role on ``loop``: it sends to the API server and adds requests through the loop."""
        if self.role == "prefill":
            return PrefillRole(loop.engine, loop.send, KVSender(loop.context))
        receiver = KVReceiver(loop.context, self.transport, self.host)
        return DecodeRole(loop.engine, loop.send, loop.add, receiver, self.timeout_s)


def role_command(
    role: str, transport: str = "shm", host: str = "127.0.0.1", timeout_s: float = DEFAULT_TIMEOUT_S
) -> list[str]:
    """The engine process's command after the interpreter, for ``AsyncEngine(process_args=...)``."""
    return [
        "-m",
        MODULE,
        "--role",
        role,
        "--kv-transport",
        transport,
        "--kv-host",
        host,
        "--kv-timeout",
        str(timeout_s),
    ]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", add_help=False)
    p.add_argument("--role", choices=ROLES, required=True, help="the disaggregated role")
    p.add_argument("--kv-transport", choices=TRANSPORTS, default="shm", help="how KV pages travel")
    p.add_argument("--kv-host", default="127.0.0.1", help="the decode engine's KV address, with tcp")
    p.add_argument("--kv-timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds a reservation waits")
    args, rest = p.parse_known_args(argv)
    options = RoleOptions(args.role, args.kv_transport, args.kv_host, args.kv_timeout)
    engine_process.main(rest, options.build)


if __name__ == "__main__":
    main()
