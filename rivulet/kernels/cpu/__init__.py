"""C++ CPU kernels, compiled on first use for the machine they run on (`-O3 -march=native`).

`load_cpu_ext()` returns the compiled module, or None when no C++ compiler is available (callers
then use the PyTorch reference). The build is cached under ~/.cache/rivulet/cpu_ext/<hash> (or
$RIVULET_CACHE_DIR), keyed by the sources, the torch version and location and the CPU's flags, so it
is compiled once per machine and environment (1-5 minutes on 2 cores).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import threading
from functools import lru_cache
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

_SOURCES = ["quant_linear.cpp", "cpu_ops.cpp", "gguf_dequant.cpp", "amx_linear.cpp", "prefill_attention.cpp",
            "amx_attention.cpp", "bf16_linear.cpp", "decode_program.cpp", "sampling.cpp",
            "top_k_top_p.cpp"]
_HEADERS = ["prefill_attention.h", "simd.h", "quant_gemv.h", "rowwise.h", "decode_attention.h", "bf16_panels.h",
            "amx_tiles.h"]  # copied beside the sources, hashed with them, not compiled alone
_LOCK = threading.Lock()


def cache_dir() -> Path:
    root = os.environ.get("RIVULET_CACHE_DIR") or Path.home() / ".cache" / "rivulet"
    return Path(root) / "cpu_ext"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


@lru_cache(maxsize=1)
def load_cpu_ext() -> ModuleType | None:
    """The compiled kernels, or None (no compiler, or the build failed: logged once)."""
    import torch
    from torch.utils import cpp_extension

    if os.environ.get("RIVULET_DISABLE_CPU_EXT") == "1":
        return None
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        logger.warning("no C++ compiler found: CPU int8 kernels are unavailable, using PyTorch ops")
        return None
    here = Path(__file__).parent
    sources = [str(here / s) for s in _SOURCES]
    files = sources + [str(here / s) for s in _HEADERS]
    h = hashlib.sha256(torch.__version__.encode())
    h.update(_cpu_flags().encode())  # -march=native: a build is for this CPU's instruction sets only
    # the include paths ninja compiles with come from torch's location: one folder per location (a venv reached
    # through a symlink is another), or two environments would rebuild the same folder in turn
    h.update(str(Path(torch.__file__).parent).encode())
    for s in files:
        h.update(Path(s).read_bytes())
    build = cache_dir() / h.hexdigest()[:16]
    build.mkdir(parents=True, exist_ok=True)
    build = build.resolve()  # ninja records absolute paths: a cache reached through a link must name the same ones
    with _LOCK, open(build / "build.flock", "w") as held:
        # torch's own lock (`build/lock`, a file that exists while a build runs) outlives a build that was killed
        # and then makes every later start wait forever; builds here are serialized by an flock instead, which
        # the system releases with its process, so whoever holds it knows any `lock` file left is stale
        fcntl.flock(held, fcntl.LOCK_EX)
        (build / "lock").unlink(missing_ok=True)
        try:
            # build from copies inside the build folder: the ninja file then names the same paths for
            # every checkout of the same sources, which would otherwise each force a rebuild (~60 s)
            for src in files:
                dst = build / Path(src).name
                if not dst.exists() or dst.read_bytes() != Path(src).read_bytes():
                    tmp = dst.with_suffix(f".{os.getpid()}.tmp")  # ranks start together: replace atomically
                    shutil.copyfile(src, tmp)
                    os.replace(tmp, dst)
            local = [str(build / Path(src).name) for src in sources]
            return cpp_extension.load(
                name="rivulet_cpu_ext", sources=local, build_directory=str(build),
                extra_cflags=["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp"],
                extra_ldflags=["-fopenmp"], verbose=False,
            )
        except Exception as e:  # noqa: BLE001 - any build failure means "use the fallback"
            logger.warning("building the CPU kernels failed (%s); using PyTorch ops", str(e).splitlines()[-1:])
            return None
