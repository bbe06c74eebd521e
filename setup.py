"""Build of pyattn._core: C11, -O3, OpenMP when the compiler has it (probed by compiling and
running a test program), ISA-specific code through target attributes chosen at run time.

Environment:
  PYATTN_NATIVE=1    add -march=native (off by default: the wheel must run on any x86-64)
  PYATTN_SANITIZE=1  build with -fsanitize=address,undefined and -fno-wrapv (tests/sanitize.sh)
  PYATTN_NO_OPENMP=1 skip OpenMP
"""
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor

import numpy
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

SOURCES = [
    "csrc/module.c",
    "csrc/bind/args.c",
    "csrc/bind/softmax.c",
    "csrc/bind/sparse.c",
    "csrc/bind/feature_maps.c",
    "csrc/bind/linear.c",
    "csrc/bind/delta.c",
    "csrc/bind/dplr.c",
    "csrc/bind/log_linear.c",
    "csrc/bind/nn.c",
    "csrc/bind/runtime.c",
    "csrc/bind/bf16.c",
    "csrc/array_cache.c",
    "csrc/dispatch.c",
    "csrc/core/parallel.c",
    "csrc/core/bf16_convert.c",
    "csrc/core/gemm_bf16.c",
    "csrc/isa/avx512.c",
    "csrc/isa/avx2.c",
    "csrc/isa/generic.c",
]

PROBE = r"""
#include <omp.h>
#include <stdio.h>
int main(void) {
    int n = 0;
#pragma omp parallel reduction(+ : n)
    n += 1;
    printf("%d\n", n);
    return n == omp_get_max_threads() ? 0 : 1;
}
"""


def _compiler_name(cc):
    try:
        out = subprocess.run(cc + ["--version"], capture_output=True, text=True, timeout=30)
        return out.stdout.splitlines()[0].strip()
    except (OSError, IndexError, subprocess.SubprocessError):
        return " ".join(cc)


def _openmp_works(cc):
    """Compile, link and run a small OpenMP program with the extension's compiler."""
    if os.environ.get("PYATTN_NO_OPENMP") == "1":
        return False
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "probe.c")
        exe = os.path.join(tmp, "probe")
        with open(src, "w") as f:
            f.write(PROBE)
        try:
            built = subprocess.run(cc + ["-fopenmp", src, "-o", exe], capture_output=True, timeout=120)
            if built.returncode != 0:
                return False
            ran = subprocess.run([exe], capture_output=True, timeout=60)
            return ran.returncode == 0
        except (OSError, subprocess.SubprocessError):
            return False


class BuildExt(build_ext):
    def build_extensions(self):
        cc = list(self.compiler.compiler_so[:1]) if hasattr(self.compiler, "compiler_so") else ["cc"]
        if shutil.which(cc[0]) is None:
            cc = [sysconfig.get_config_var("CC") or "cc"]
        compiler = _compiler_name(cc)
        cflags = ["-std=c11", "-O3", "-ffp-contract=fast", "-fno-math-errno", "-fvisibility=hidden",
                  "-Wall", "-Wno-unknown-pragmas", f'-DPYATTN_COMPILER="{compiler}"']
        ldflags = []
        if os.environ.get("PYATTN_NATIVE") == "1":
            cflags.append("-march=native")
        if os.environ.get("PYATTN_SANITIZE") != "1":
            # Python's own CFLAGS carry -g: debug info made the wheel's _core 11 MB
            cflags.append("-g0")
        else:
            # -g1: the line tables a sanitizer report's stack needs, without the debug info of
            # every local, which doubled the compile time of each ISA unit
            san = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-g1", "-O1"]
            # CPython's own CFLAGS carry -fwrapv, which defines signed overflow and so hides it
            # from UBSan; these flags come after them and win
            cflags += san + ["-fno-wrapv"]
            ldflags += san[:1]
        if _openmp_works(cc):
            cflags.append("-fopenmp")
            ldflags.append("-fopenmp")
        else:
            sys.stderr.write(
                "\n*** pyattn: WARNING: the compiler could not build and run an OpenMP program; "
                "building a SERIAL pyattn (one thread). Install libgomp / libomp to get threads. ***\n\n"
            )
        for ext in self.extensions:
            ext.extra_compile_args = cflags
            ext.extra_link_args = ldflags
        self.compiler.compile = _compile_in_parallel.__get__(self.compiler)
        super().build_extensions()


def _compile_in_parallel(compiler, sources, output_dir=None, macros=None, include_dirs=None,
                         debug=0, extra_preargs=None, extra_postargs=None, depends=None):
    """CCompiler.compile with its sources compiled side by side, one per core: the three ISA
    translation units hold nearly all the code, and compiling them one after another was most
    of a build's time."""
    macros, objects, extra_postargs, pp_opts, build = compiler._setup_compile(
        output_dir, macros, include_dirs, sources, depends, extra_postargs)
    cc_args = compiler._get_cc_args(pp_opts, debug, extra_preargs)

    def one(obj):
        src, ext = build[obj]
        compiler._compile(obj, src, ext, cc_args, extra_postargs, pp_opts)

    with ThreadPoolExecutor(max(1, min(len(objects), os.cpu_count() or 1))) as pool:
        list(pool.map(one, objects))
    return objects


setup(
    ext_modules=[
        Extension(
            "pyattn._core",
            sources=SOURCES,
            include_dirs=[numpy.get_include(), "csrc"],
            depends=[os.path.join(dp, f) for dp, _, fs in os.walk("csrc") for f in fs],
        )
    ],
    cmdclass={"build_ext": BuildExt},
    # the License and Home-page fields, the ones `pip show` reads at every pip version
    license="MIT",
    url="https://github.com/pyattn/pyattn",
)
