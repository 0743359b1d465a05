"""Compiled CPU kernels, built on first use with torch.utils.cpp_extension (g++ and ninja), and
cached per CPU-flag set. Every kernel has a pure-PyTorch twin that serves when a build is not
possible or `SERVEWISE_KERNELS=torch` is set; `status()` says which path is active."""
from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import threading
import time

_lock = threading.Lock()
_state: dict = {}
STALE_BUILD_LOCK_S = 300  # a build takes about a minute; an older lock was left by a killed build


def _cpu_flags_line() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def cpu_flags() -> str:
    """The CPU's SIMD flags that matter to these kernels and to oneDNN (for benchmark reports)."""
    have = set(_cpu_flags_line().split())
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")
    return " ".join(f for f in wanted if f in have) or "unknown"


def last_level_cache_bytes() -> int | None:
    """The largest CPU cache (per socket, from sysfs), or None where the system does not say."""
    import glob

    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            text = open(path).read().strip()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
        digits = text.rstrip("KMGkmg")
        if digits.isdigit():
            sizes.append(int(digits) * unit)
    return max(sizes) if sizes else None


# one module; paged_attention.cpp declares the functions of the others
SOURCES = ("paged_attention.cpp", "layer_ops.cpp", "linear_bf16.cpp", "linear_f32.cpp", "prompt_attention.cpp")


def source_digest() -> str:
    """A digest of the compiled kernels' sources (the .cpp files and the headers they include)."""
    here = os.path.dirname(__file__)
    names = sorted(SOURCES + tuple(f for f in os.listdir(here) if f.endswith(".h")))
    h = hashlib.sha256()
    for name in names:
        with open(os.path.join(here, name), "rb") as f:
            h.update(name.encode() + f.read())
    return h.hexdigest()[:16]


def _module_name() -> str:
    return f"servewise_cpu_kernels_{_cpu_tag()}"


def _cpu_tag() -> str:
    """The build flags depend on the CPU (-march=native): a cache shared by machines with other flags
    must not hand one machine another's binary."""
    return hashlib.sha1(_cpu_flags_line().encode()).hexdigest()[:10]


def cpu_ext():
    """The compiled module, or None (with the reason in status())."""
    with _lock:
        if "ext" in _state:
            return _state["ext"]
        _state["ext"], _state["why"] = None, ""
        if os.environ.get("SERVEWISE_KERNELS", "auto") == "torch":
            _state["why"] = "SERVEWISE_KERNELS=torch"
            return None
        here = os.path.dirname(__file__)
        sources = [os.path.join(here, f) for f in SOURCES]
        try:
            from torch.utils.cpp_extension import load

            _clear_stale_lock()
            with _build_progress():
                _state["ext"] = load(name=_module_name(), sources=sources,
                                     extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                                     verbose=False)
        except Exception as e:  # no compiler, no ninja, a failed build: the PyTorch path serves
            _state["why"] = f"build failed: {type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
        return _state["ext"]


BUILD_NOTE_EVERY_S = 30.0  # a build in progress says so this often
UP_TO_DATE_S = 10.0  # a "build" shorter than this found the module up to date


@contextlib.contextmanager
def _build_progress():
    """A build says so on stderr (a server's log) instead of being silent for minutes: before it starts where
    one is due (no module built yet, or sources other than the last build's: changed, or at another path),
    every BUILD_NOTE_EVERY_S while it runs, and how long it took."""
    where = _build_dir()
    stamp = os.path.join(where, "servewise-sources") if where else None  # what the last build was made from
    mine = f"{source_digest()} {os.path.dirname(os.path.abspath(__file__))}"
    try:
        with open(stamp) as f:
            due = f.read() != mine or not _built_before()
    except (OSError, TypeError):
        due = True
    say = lambda m: print(f"servewise: {m}", file=sys.stderr, flush=True)  # noqa: E731
    t0, done = time.perf_counter(), threading.Event()
    if due:
        say("building the CPU kernels (first use on this machine, or their sources changed or moved; 2-4 minutes "
            "on 2 cores, less on more)...")

        def note():
            while not done.wait(BUILD_NOTE_EVERY_S):
                say(f"still building the CPU kernels ({time.perf_counter() - t0:.0f} s)...")
        threading.Thread(target=note, daemon=True).start()
    try:
        yield
    finally:
        done.set()
    if due:
        took = time.perf_counter() - t0
        say(f"built the CPU kernels in {took:.0f} s" if took > UP_TO_DATE_S else "the CPU kernels were up to date")
        try:
            with open(stamp, "w") as f:
                f.write(mine)
        except (OSError, TypeError):
            pass


def _build_dir() -> str | None:
    from torch.utils.cpp_extension import _get_build_directory

    try:
        return _get_build_directory(_module_name(), verbose=False)
    except Exception:
        return None


def _built_before() -> bool:
    d = _build_dir()
    return any(f.endswith(".so") for f in os.listdir(d)) if d and os.path.isdir(d) else False


def _clear_stale_lock() -> None:
    """A build killed midway leaves its lock file, and every later start would wait on it forever."""
    d = _build_dir()
    lock = os.path.join(d, "lock") if d else None
    try:
        if lock and time.time() - os.path.getmtime(lock) > STALE_BUILD_LOCK_S:
            os.remove(lock)
            print(f"servewise: removed a stale kernel build lock ({lock})", file=sys.stderr, flush=True)
    except OSError:
        pass


def status() -> str:
    ext = cpu_ext()
    if ext is not None:
        return ("compiled CPU kernels: paged decode attention (reads KV blocks in place), prompt attention, RMSNorm, "
                "rotary, SiLU-mul, KV writes, linear in column panels (fp32 with AVX-512, bf16 with AVX512_BF16), bf16 "
                "linear in fp32 arithmetic (where the CPU has no bf16 dot products)")
    return (f"PyTorch path: attention by SDPA (decode: after a gather), element-wise ops by operator "
            f"({_state.get('why', '')})")


def _family(device: str) -> str:
    """Which kernels serve a device: "torch" (SERVEWISE_KERNELS=torch), "triton" (CUDA, or
    SERVEWISE_KERNELS=triton on any device) or "compiled" (the C++ ones on CPU, none elsewhere)."""
    choice = os.environ.get("SERVEWISE_KERNELS", "auto")
    if choice == "torch":
        return "torch"
    return "triton" if choice == "triton" or device.startswith("cuda") else "compiled"


def layer_ops(device: str):
    """A layer's element-wise kernels (RMSNorm, residual add + RMSNorm, rotary, SiLU-mul) for a device, or
    None for the PyTorch operators: the compiled C++ ones on CPU, the Triton ones on CUDA (and on CPU with
    SERVEWISE_KERNELS=triton under TRITON_INTERPRET=1, as attention_kernel chooses)."""
    family = _family(device)
    if family == "triton":
        try:
            from servewise.kernels.triton_ops import TritonLayerOps
        except ImportError:
            return None
        return TritonLayerOps() if device.startswith("cuda") or os.environ.get("TRITON_INTERPRET") == "1" else None
    return cpu_ext() if family == "compiled" and device.startswith("cpu") else None


def attention_kernel(device: str):
    """(the paged-attention kernels for a device, or None for the PyTorch path; what was chosen, in words).

    CPU: the compiled C++ decode kernel. CUDA: the Triton kernels (decode and prefill), when Triton
    imports. SERVEWISE_KERNELS=torch: the PyTorch path everywhere; SERVEWISE_KERNELS=triton: the
    Triton kernels on any device (on CPU under TRITON_INTERPRET=1, slowly: how the tests check them)."""
    family = _family(device)
    if family == "torch":
        return None, "PyTorch path: gather + SDPA (SERVEWISE_KERNELS=torch)"
    if family == "triton":
        try:
            from servewise.kernels.triton_attention import TritonAttention
        except ImportError as e:  # (Triton ships with PyTorch's CUDA builds; not with the CPU wheel)
            return None, f"PyTorch path: gather + SDPA (no Triton: {e})"
        if device.startswith("cpu") and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("SERVEWISE_KERNELS=triton on CPU needs TRITON_INTERPRET=1 (Triton's interpreter)")
        kernel = TritonAttention()
        return kernel, kernel.name
    kernel = cpu_ext() if device.startswith("cpu") else None
    return kernel, status() if device.startswith("cpu") else "PyTorch path: gather + SDPA"


def triton_compiled() -> int:
    """Kernels Triton has compiled in this process so far: every specialization of every kernel of the
    GPU path (0 without Triton, and under its interpreter)."""
    try:
        from servewise.kernels import triton_attention, triton_ops
    except ImportError:
        return 0
    return sum(len(cache[0]) for module in (triton_attention, triton_ops) for fn in vars(module).values()
               for cache in getattr(fn, "device_caches", {}).values())
