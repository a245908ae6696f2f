"""``ggml-rpc-server``: upstream's RPC server as built by hybrimoe (same flags), started with hybrimoe's and
llama-cpp-python's library folders on its search path. A console script of its own, not a ``hybrimoe`` subcommand."""
from __future__ import annotations

import os
import sys

from hybrimoe._lib import server_env
from hybrimoe.runtime.rpc import SERVER_BIN


def main() -> None:
    """Replaces this process with ``hybrimoe/lib/ggml-rpc-server`` and the given arguments; exits 1 with one line
    when hybrimoe was not built."""
    if not SERVER_BIN.exists():
        print(f"ggml-rpc-server: {SERVER_BIN} is missing (hybrimoe not built)", file=sys.stderr)
        sys.exit(1)
    os.execve(str(SERVER_BIN), [str(SERVER_BIN)] + sys.argv[1:], server_env(os.environ))
