"""The few ggml-backend registry functions hybrimoe needs from Python (ctypes over llama-cpp-python's libggml), with
one table of their C signatures (:func:`libggml`).

Used to register the RPC backend (our ``lib/libggml-rpc.so``, a loadable ggml backend module), add RPC
servers, find buffer types by name for tensor overrides (as upstream's ``--rpc`` and ``-ot`` do:
common/arg.cpp ``add_rpc_devices`` and ``parse_tensor_buffer_overrides``), and ask a device its memory and its
pinned host buffer type.
"""
from __future__ import annotations

import ctypes
import socket
import struct
from functools import lru_cache

from hybrimoe._lib import LIB_DIR, llama_cpp_lib_dir
from hybrimoe.envs import RPC_TIMEOUT_ENV, rpc_timeout_s

_p = ctypes.c_void_p


@lru_cache(maxsize=1)
def libggml() -> ctypes.CDLL:
    """libggml of llama-cpp-python, with argument types declared. Raises OSError when it cannot be loaded."""
    lib_dir = llama_cpp_lib_dir()
    cands = sorted(lib_dir.glob("libggml.so*"))
    if not cands:
        raise OSError(f"libggml.so not found in {lib_dir}")
    lib = ctypes.CDLL(str(cands[0]), mode=ctypes.RTLD_GLOBAL)
    sig = {
        "ggml_backend_load": ([ctypes.c_char_p], _p),
        "ggml_backend_register": ([_p], None),
        "ggml_backend_reg_by_name": ([ctypes.c_char_p], _p),
        "ggml_backend_reg_get_proc_address": ([_p, ctypes.c_char_p], _p),
        "ggml_backend_reg_name": ([_p], ctypes.c_char_p),
        "ggml_backend_dev_count": ([], ctypes.c_size_t),
        "ggml_backend_dev_get": ([ctypes.c_size_t], _p),
        "ggml_backend_dev_name": ([_p], ctypes.c_char_p),
        "ggml_backend_dev_description": ([_p], ctypes.c_char_p),
        "ggml_backend_dev_type": ([_p], ctypes.c_int),
        "ggml_backend_dev_backend_reg": ([_p], _p),
        "ggml_backend_dev_buffer_type": ([_p], _p),
        "ggml_backend_dev_memory": ([_p, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)], None),
        "ggml_backend_dev_host_buffer_type": ([_p], _p),
        "ggml_backend_buft_name": ([_p], ctypes.c_char_p),
    }
    for name, (args, res) in sig.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = res
    return lib


# ggml_backend_dev_type
DEV_CPU, DEV_GPU, DEV_IGPU, DEV_ACCEL = 0, 1, 2, 3

_registered_endpoints: dict[str, int] = {}


def devices(memory: bool = True) -> list[dict]:
    """All registered ggml devices: dicts with ``ptr``, ``name``, ``description``, ``type``, ``reg``, ``buft``,
    ``buft_name``, ``free`` and ``total`` (bytes; 0 with ``memory=False``, which asks no device: an RPC server
    that has gone away is not contacted)."""
    g = libggml()
    out = []
    for i in range(g.ggml_backend_dev_count()):
        d = g.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        if memory:
            g.ggml_backend_dev_memory(d, ctypes.byref(free), ctypes.byref(total))
        reg = g.ggml_backend_dev_backend_reg(d)
        buft = g.ggml_backend_dev_buffer_type(d)
        out.append({
            "ptr": d,
            "name": g.ggml_backend_dev_name(d).decode(),
            "description": (g.ggml_backend_dev_description(d) or b"").decode(),
            "type": g.ggml_backend_dev_type(d),
            "reg": (g.ggml_backend_reg_name(reg) or b"").decode() if reg else "",
            "buft": buft,
            "buft_name": g.ggml_backend_buft_name(buft).decode() if buft else "",
            "free": free.value,
            "total": total.value,
        })
    return out


def rpc_reg() -> int:
    """The RPC backend registry, loading ``hybrimoe/lib/libggml-rpc.so`` on first use.

    Raises:
        RuntimeError: the module is missing or does not load.
    """
    g = libggml()
    reg = g.ggml_backend_reg_by_name(b"RPC")
    if reg:
        return reg
    path = LIB_DIR / "libggml-rpc.so"
    if not path.exists():
        raise RuntimeError(f"{path} is missing: hybrimoe's RPC backend was not built")
    reg = g.ggml_backend_load(str(path).encode())
    if not reg:
        raise RuntimeError(f"could not load the RPC backend {path}")
    return reg


def add_rpc_server(endpoint: str) -> list[int]:
    """Register the devices of an RPC server ``HOST:PORT`` (upstream ``--rpc``); returns their device pointers.

    Idempotent per endpoint. Checks first, with a HELLO handshake of its own bounded by
    :func:`hybrimoe.envs.rpc_timeout_s` (``$HYBRIMOE_RPC_TIMEOUT_S``, default 5 s), that a ggml RPC server of our
    protocol answers there: ggml's
    RPC client, before hybrimoe patch 0003, aborts the process on an endpoint that is not a server and waits
    forever on one that never answers; with the patch it fails with a log line, and this gives the reason.

    Raises:
        ValueError: the endpoint is not ``HOST:PORT``; what listens there is not a ggml RPC server of our
            protocol, or one busy with another client (no valid HELLO reply within the timeout).
        RuntimeError: nothing listens there, or the RPC backend could not add the server.
    """
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"RPC endpoint must be HOST:PORT, got {endpoint!r}")
    g = libggml()
    if endpoint not in _registered_endpoints:
        check_rpc_server(endpoint, host.strip("[]"), int(port))
        reg = rpc_reg()
        fn_addr = g.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_rpc_add_server")
        if not fn_addr:
            raise RuntimeError("the RPC backend lacks ggml_backend_rpc_add_server")
        add_server = ctypes.CFUNCTYPE(_p, ctypes.c_char_p)(fn_addr)
        server_reg = add_server(endpoint.encode())
        if not server_reg:
            raise RuntimeError(f"could not add RPC server {endpoint} (see the ggml log above)")
        g.ggml_backend_register(server_reg)
        _registered_endpoints[endpoint] = server_reg
    return _endpoint_devices(endpoint)


def rpc_connection_error(endpoint: str) -> str:
    """Why ggml's connection to the RPC server ``endpoint`` is dead ("disconnected (Broken pipe, during
    SET_TENSOR)"...), or "" while it works, when no connection is open, or when the RPC backend is not loaded or
    predates hybrimoe patch 0003. Never opens a connection.

    ggml logs the loss once, but llama-cpp-python's log callback shows ggml's errors only with ``verbose=True``
    (it maps this ggml's ERROR level to DEBUG): errors raised to the user carry this text instead."""
    g = libggml()
    reg = g.ggml_backend_reg_by_name(b"RPC")
    if not reg:
        return ""
    fn_addr = g.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_rpc_connection_error")
    if not fn_addr:
        return ""
    fn = ctypes.CFUNCTYPE(ctypes.c_char_p, ctypes.c_char_p)(fn_addr)
    return (fn(endpoint.encode()) or b"").decode(errors="replace")


def _endpoint_devices(endpoint: str) -> list[int]:
    # RPC devices hang off the one "RPC" registry; each names its server in its buffer type, "RPCn[HOST:PORT]"
    # (ggml-rpc.cpp), or in its description
    return [d["ptr"] for d in devices(memory=False)
            if d["buft_name"].endswith(f"[{endpoint}]") or d["description"] == endpoint]


# ggml RPC protocol (ggml-rpc.cpp / ggml-rpc.h of the pinned llama.cpp): HELLO is command 14; its request is
# conn_caps[24], its reply major, minor, patch, padding, conn_caps[24]; sizes are uint64 little-endian.
RPC_CMD_HELLO = 14
RPC_PROTO_MAJOR_VERSION, RPC_PROTO_MINOR_VERSION = 7, 0
_RPC_CONN_CAPS_SIZE = 24


def check_rpc_server(endpoint: str, host: str, port: int, timeout: float | None = None) -> None:
    """HELLO handshake with ``endpoint`` (then disconnect: the server serves one client at a time), within
    ``timeout`` seconds (default :func:`rpc_timeout_s`)."""
    timeout = rpc_timeout_s() if timeout is None else timeout
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as e:
        raise RuntimeError(f"RPC server {endpoint} is not reachable: {e}") from None
    reply, want = b"", 8 + 4 + _RPC_CONN_CAPS_SIZE
    try:
        with sock:
            sock.sendall(struct.pack("<BQ", RPC_CMD_HELLO, _RPC_CONN_CAPS_SIZE) + bytes(_RPC_CONN_CAPS_SIZE))
            while len(reply) < want:
                chunk = sock.recv(want - len(reply))
                if not chunk:
                    break
                reply += chunk
    except socket.timeout:
        # ggml-rpc-server serves one client at a time: while it serves another, a second client's connection is
        # accepted (the listen backlog) and its handshake waits, exactly like a listener that is no RPC server
        raise ValueError(f"the RPC server at {endpoint} is busy with another client (it serves one at a time), or "
                         f"{endpoint} is not a ggml RPC server: no reply to the RPC handshake within {timeout:g} s "
                         f"({RPC_TIMEOUT_ENV} sets the timeout)") from None
    except OSError as e:
        raise ValueError(f"{endpoint} is not a ggml RPC server: the RPC handshake failed: {e}") from None
    if len(reply) < want or struct.unpack_from("<Q", reply)[0] != 4 + _RPC_CONN_CAPS_SIZE:
        raise ValueError(f"{endpoint} is not a ggml RPC server of protocol {RPC_PROTO_MAJOR_VERSION}.x: "
                         f"unexpected reply to the RPC handshake ({reply[:16]!r})")
    major, minor, patch = reply[8], reply[9], reply[10]
    if major != RPC_PROTO_MAJOR_VERSION or minor > RPC_PROTO_MINOR_VERSION:
        raise ValueError(f"RPC server {endpoint} speaks protocol {major}.{minor}.{patch}, hybrimoe's RPC "
                         f"backend needs {RPC_PROTO_MAJOR_VERSION}.x with x <= {RPC_PROTO_MINOR_VERSION}")


def rpc_device_ptrs() -> set[int]:
    """Device pointers of every RPC server registered by this process."""
    return {p for ep in _registered_endpoints for p in _endpoint_devices(ep)}


def local_gpus() -> list[int]:
    """Device pointers of this machine's accelerators (GPU or integrated GPU), without the RPC servers this
    process registered (those belong to the Llama instances that named them)."""
    rpc = rpc_device_ptrs()
    return [d["ptr"] for d in devices(memory=False) if d["type"] in (DEV_GPU, DEV_IGPU) and d["ptr"] not in rpc]


#: what :func:`accelerator` finds, in words, for the messages that find none: any GPU ggml has a back end for (the
#: ones README documents a build for named)
ACCELERATOR_KINDS = 'a CUDA or Vulkan GPU (llama-cpp-python built with that back end: README "GPU back ends")'


def accelerator(rpc_devs: list[int]) -> int | None:
    """The device the MoE engine caches experts on: the first of ``rpc_devs`` (an instance's own RPC servers),
    else this machine's first GPU, else None."""
    if rpc_devs:
        return rpc_devs[0]
    gpus = local_gpus()
    return gpus[0] if gpus else None


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")


def device_label(ptr: int | None) -> str:
    """A device's description (e.g. "NVIDIA H200", or HOST:PORT for an RPC server), else its name; "cpu" for
    None. Calibrations are stored under it.

    An RPC server on this machine (a loopback HOST) is labelled by its host and the device memory it reports,
    ``127.0.0.1-rpc-2048MiB``, not by its port: a stand-in started again on another port (``--stand-in``, the
    tests' servers) is the same device, and its calibration is found again."""
    if not ptr:
        return "cpu"
    d = next(x for x in devices(memory=False) if x["ptr"] == ptr)
    label = d["description"] or d["name"]
    host, sep, port = label.rpartition(":")
    if sep and port.isdigit() and host in LOOPBACK_HOSTS and ptr in rpc_device_ptrs():
        total = next(x for x in devices(memory=True) if x["ptr"] == ptr)["total"]
        return f"{host}-rpc-{total // 2**20}MiB"
    return label


def buffer_type(name: str) -> int:
    """A buffer type by its name: a device's default one as upstream's ``-ot`` accepts it (``CPU``, ``CUDA0``,
    ``RPC0[host:port]``...: common/arg.cpp ``parse_tensor_buffer_overrides``), else a device's pinned host buffer
    type (``CUDA_Host``, ``Vulkan_Host``: ``ggml_backend_dev_host_buffer_type``), where hybrimoe's engine keeps the
    routed experts. Case-sensitive.

    Raises:
        ValueError: no device has a buffer type of that name (the message lists the known names).
    """
    devs = devices(memory=False)
    for d in devs:
        if d["buft_name"] == name:
            return d["buft"]
    g = libggml()
    hosts = {}
    for d in devs:
        hb = g.ggml_backend_dev_host_buffer_type(d["ptr"])
        if hb:
            hosts[g.ggml_backend_buft_name(hb).decode()] = hb
    if name in hosts:
        return hosts[name]
    known = ", ".join(sorted({d["buft_name"] for d in devs} | set(hosts)))
    raise ValueError(f"unknown buffer type {name!r} in a tensor override; known: {known}")


def host_buffer_type_name(device_ptr: int) -> str | None:
    """Name of the device's pinned host buffer type (e.g. ``CUDA_Host``), or None when it has none (RPC)."""
    g = libggml()
    buft = g.ggml_backend_dev_host_buffer_type(device_ptr)
    if not buft:
        return None
    return g.ggml_backend_buft_name(buft).decode()


def device_memory(device_ptr: int) -> tuple[int, int]:
    """(free, total) bytes of a ggml device (asks that device only: ``ggml_backend_dev_memory``)."""
    g = libggml()
    free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
    g.ggml_backend_dev_memory(ctypes.c_void_p(device_ptr), ctypes.byref(free), ctypes.byref(total))
    return int(free.value), int(total.value)
