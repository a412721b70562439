"""Build a C++ CPU extension from its source files with the machine's own compiler.

Torch's extension mechanism compiles them with -O3 -march=native -fopenmp (and the module's own
flags, if any) and links them into one module; the build is cached per CPU (model and
instruction-set flags), torch version, flags, sources and the headers beside them under
`~/.cache/hybridserve/kernels`, so a checkout shared by different machines never runs code
built for another CPU. When the build cannot happen (no compiler, no ninja, a compiler or
linker error), `build_cpu_extension` returns None and `build_failure(name)` says why; a
`CpuExtension` (the modules are in `extensions.py`) caches the result, so each module builds,
and fails, once per process and on its own.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import shutil
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

_failures: dict[str, str] = {}


def cpu_signature() -> str:
    """CPU model and instruction-set flags (Linux /proc/cpuinfo; the platform string elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    fields = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return f"{fields.get('model name', '?')}|{fields.get('flags', '')}"


def build_dir(name: str, sources: tuple[Path, ...], flags: tuple[str, ...] = ()) -> Path:
    """The build's folder, keyed on everything the build depends on: the CPU, torch, the flags,
    every source (its name and text) and the headers beside them (which the sources include by
    name, `vector_math.h`): a source or header edited while an old build is cached must not run
    the old code."""
    folders = sorted({s.parent for s in sources})
    headers = sorted(h for folder in folders for h in folder.glob("*.h"))
    texts = b"".join(f.name.encode() + b"\0" + f.read_bytes() + b"\0" for f in (*sources, *headers))
    identity = f"{cpu_signature()}|{torch.__version__}|{' '.join(flags)}|{texts!r}"
    key = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return Path.home() / ".cache" / "hybridserve" / "kernels" / f"{name}-{key}"


def build_cpu_extension(
    name: str, sources: tuple[Path, ...], fallback: str, flags: tuple[str, ...] = ()
) -> ModuleType | None:
    """The compiled module, or None when it cannot be built here: the reason is logged (with
    `fallback`, what runs instead) and kept for `build_failure(name)`. `flags`: compiler flags
    of this module beyond the common ones (part of the build cache's key)."""
    _put_pip_ninja_on_path()
    if shutil.which("ninja") is None or shutil.which("c++") is None:
        failure = "no ninja or c++ on PATH"
    else:
        try:
            from torch.utils.cpp_extension import load

            out = build_dir(name, sources, flags)
            out.mkdir(parents=True, exist_ok=True)
            with _one_builder(out):
                module = load(
                    name=name,
                    sources=[str(s) for s in _sources_in(out, sources)],
                    build_directory=str(out),
                    extra_cflags=["-O3", "-march=native", "-fopenmp", *flags],
                    extra_ldflags=["-fopenmp"],
                    verbose=False,
                )
            _failures.pop(name, None)
            return module
        except (OSError, RuntimeError, ImportError, SystemExit) as e:  # compiler or linker failures
            failure = f"{type(e).__name__}: {e}"
    _failures[name] = failure
    log.warning("%s unavailable (%s); running %s", name, failure, fallback)
    return None


def _sources_in(out: Path, sources: tuple[Path, ...]) -> list[Path]:
    """The sources (and the headers beside them) copied into the build folder, which the build
    then compiles: torch's build file names its sources by absolute path, so two checkouts of the
    same code (a second worktree, CI's fresh clone) would rewrite it in turn and rebuild each
    time. A copy is written only when missing or different: its age tells ninja nothing changed."""
    folders = {folder: out / "src" / str(i) for i, folder in enumerate(sorted({s.parent for s in sources}))}
    for folder, copy in folders.items():
        copy.mkdir(parents=True, exist_ok=True)
        for original in [*(s for s in sources if s.parent == folder), *folder.glob("*.h")]:
            target = copy / original.name
            text = original.read_bytes()
            if not target.is_file() or target.read_bytes() != text:
                target.write_bytes(text)
    return [folders[s.parent] / s.name for s in sources]


@contextlib.contextmanager
def _one_builder(out: Path):
    """One process at a time loads (and if need be builds) the module in `out`, under an flock
    that the kernel drops when its holder dies. Torch's own lock file (`out/lock`) stays behind
    when a build is killed (a replica stopped during start-up), and every later load of the
    module would wait for it forever; under the flock no live process holds it, so it goes."""
    with open(out / "build.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        stale = out / "lock"
        if stale.exists():
            log.warning("removing %s, left by a build that was killed", stale)
            stale.unlink(missing_ok=True)
        yield


class CpuExtension:
    """One kernel module (its sources) built lazily: calling it builds (or finds built) the module
    once per process and returns it, or None when it cannot be built here; `failure()` says why.

        decode_kernels = CpuExtension("hybridserve_decode_kernels", sources, "the pure-torch decode path")
        module = decode_kernels()        # None: run the fallback named above
    """

    def __init__(self, name: str, sources: tuple[Path, ...], fallback: str, flags: tuple[str, ...] = ()):
        if not sources:
            raise ValueError(f"{name}: no sources")
        self.name, self.sources, self.fallback, self.flags = name, tuple(sources), fallback, flags
        self._built = False
        self._module: ModuleType | None = None

    def __call__(self) -> ModuleType | None:
        if not self._built:
            self._module = self.build()
            self._built = True
        return self._module

    def build(self) -> ModuleType | None:
        """Build (or find built) now, whatever an earlier call found; not remembered."""
        return build_cpu_extension(self.name, self.sources, self.fallback, self.flags)

    def failure(self) -> str | None:
        """Why the build returned None, if it did."""
        return build_failure(self.name)


def build_failure(name: str) -> str | None:
    """Why the last `build_cpu_extension(name, ...)` returned None, if it did."""
    return _failures.get(name)


def _put_pip_ninja_on_path() -> None:
    """The `ninja` wheel (a dependency) installs its binary next to the venv's interpreter, which
    is not on PATH when the venv is not activated; torch's builder looks for it on PATH."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
