"""`servewise kv-store`: the global KV store as a server, for engines on several machines."""
from __future__ import annotations

from servewise.commands.options import at_least, float_at_least, threads_arg

HELP = "serve a global KV store over the network (engines name it as --kv-store tcp://HOST:PORT)"


def arguments(p) -> None:
    p.add_argument("--dir", default=None, help="directory of the memory tier, best under /dev/shm (default: a fresh "
                                               "one there, removed at exit)")
    p.add_argument("--memory-gb", type=float_at_least(0, strict=True), default=4.0,
                   help="capacity of the memory tier, per model shape the store holds (default: 4)")
    p.add_argument("--disk-dir", default=None, help="directory of a disk tier (the memory tier's oldest entries "
                                                    "move there)")
    p.add_argument("--disk-gb", type=float_at_least(0, strict=True), default=32.0,
                   help="capacity of the disk tier, per model shape (default: 32)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface; then set "
                                                      "SERVEWISE_KV_STORE_KEY here and on every engine)")
    p.add_argument("--port", type=at_least(0, 65535), default=7077, help="port to listen on (0: any free one; default: 7077)")
    threads_arg(p)


def run(a) -> None:
    import logging
    import signal
    import sys

    from servewise.connectors.shm import make_dir, remove_dir
    from servewise.connectors.store_server import KEY_ENV, StoreServer, key_from_env

    if a.host not in ("127.0.0.1", "localhost", "::1") and not key_from_env():
        logging.getLogger("servewise").warning(
            "servewise: the KV store listens on %s without a key: anyone who reaches it can read and write KV; "
            "set %s", a.host, KEY_ENV)
    memory_dir = a.dir or make_dir()
    try:
        server = StoreServer(memory_dir, int(a.memory_gb * 2**30), a.disk_dir, int(a.disk_gb * 2**30), a.host, a.port)
    except OSError as e:
        raise ValueError(f"cannot listen on {a.host}:{a.port}: {e.strerror or e}") from None
    signal.signal(signal.SIGTERM, lambda *_: server.close())
    print(f"KV store at {server.url} (memory tier {memory_dir}, {a.memory_gb:g} GB"
          + (f"; disk tier {a.disk_dir}, {a.disk_gb:g} GB" if a.disk_dir else "") + ")", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
        if a.dir is None:
            remove_dir(memory_dir)
    sys.exit(0)
