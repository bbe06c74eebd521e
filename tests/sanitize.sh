#!/usr/bin/env bash
# Build pyattn with AddressSanitizer + UndefinedBehaviorSanitizer in a scratch copy of the
# repository and run the test suite against that build.
#
#   tests/sanitize.sh [extra pytest arguments]
#
# The copy holds the files git knows of (git ls-files: tracked ones, and untracked ones that are
# not ignored, such as new tests), so the working tree's own build is left alone. Python itself
# is not instrumented, so the gcc ASan runtime is preloaded.
# detect_leaks=0: CPython keeps allocations alive until exit by design. PYATTN_SANITIZE_RUN=1
# skips the tests marked skip_under_sanitizer (RSS measurements, the 20,000-call loop); every
# kernel form still runs forward and backward in both dtypes. Exits non-zero when a test fails
# or when any sanitizer report appears in the output (also those of subprocesses).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python}"
work="$(mktemp -d "${TMPDIR:-/tmp}/pyattn-sanitize.XXXXXX")"
log="$work/pytest.log"
if [[ "${KEEP_SANITIZE_DIR:-0}" != "1" ]]; then
    trap 'rm -rf "$work"' EXIT
fi

echo "sanitize: copying $repo to $work/src"
mkdir -p "$work/src"
# tracked files and untracked ones git does not ignore (new tests, modules not committed yet);
# not build outputs, not files deleted in the working tree
(cd "$repo" && git ls-files -z --cached --others --exclude-standard |
    while IFS= read -r -d '' f; do if [[ -f "$f" ]]; then printf '%s\0' "$f"; fi; done |
    xargs -0 cp --parents -t "$work/src")
rm -f "$work/src"/pyattn/_core*.so

echo "sanitize: building with PYATTN_SANITIZE=1"
(cd "$work/src" && PYATTN_SANITIZE=1 "$python" setup.py build_ext --inplace -q 2>&1 | grep -v '^$' || true) |
    tee "$work/build.log"
so=$(ls "$work/src"/pyattn/_core*.so 2>/dev/null | head -1 || true)
if [[ -z "$so" ]]; then
    echo "sanitize: build failed (no pyattn/_core*.so)" >&2
    exit 2
fi
# CPython's CFLAGS carry -fwrapv, under which UBSan cannot see signed overflow: every compile
# line (gcc ... -c file.c) must turn it off again
compiles="$(grep -- ' -c .*-fsanitize=address,undefined' "$work/build.log" || true)"
if [[ -z "$compiles" ]] || grep -v -q -- '-fno-wrapv' <<<"$compiles"; then
    echo "sanitize: the sanitized build does not compile with -fno-wrapv" >&2
    exit 2
fi
# nm's whole output first: under pipefail, `nm | grep -q` fails whenever grep stops reading at
# its first match before nm has written everything (nm then dies of SIGPIPE)
syms="$(nm -D "$so")"
if ! grep -q __asan_report <<<"$syms" || ! grep -q __ubsan_handle <<<"$syms"; then
    echo "sanitize: $so is not instrumented with ASan and UBSan" >&2
    exit 2
fi

libasan="$(gcc -print-file-name=libasan.so)"
if [[ ! -e "$libasan" ]]; then
    echo "sanitize: gcc's libasan.so not found (got '$libasan')" >&2
    exit 2
fi

# libstdc++ beside it: ASan resolves the real __cxa_throw when it starts, and without the C++
# runtime loaded by then, the first C++ exception thrown later (torch's, jax's) is an ASan
# CHECK failure instead of an exception
libstdcxx="$(gcc -print-file-name=libstdc++.so.6)"
export LD_PRELOAD="$libasan $libstdcxx"
# allocator_may_return_null=1: an allocation too large must reach pyattn as NULL (MemoryError
# test) instead of aborting the process. Not detect_stack_use_after_return: ASan's fake stack
# frames do not keep the 64-byte alignment GCC gives the AVX-512 vector locals, and the aligned
# zmm stores then fault (a limitation of the tool, not of pyattn).
export ASAN_OPTIONS="detect_leaks=0:allocator_may_return_null=1:abort_on_error=0:halt_on_error=1:exitcode=99:strict_string_checks=1:check_initialization_order=1"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:exitcode=98"
export PYTHONPATH="$work/src"
export PYATTN_SANITIZE_RUN=1

cd "$work/src"
where=$("$python" -c 'import pyattn, os; print(os.path.dirname(pyattn.__file__))')
if [[ "$where" != "$work/src/pyattn" ]]; then
    echo "sanitize: imported pyattn from $where, not from the sanitized copy" >&2
    exit 2
fi
# Under the sanitizers the suite is CPU-bound in one process: with pytest-xdist (the test
# extra) one worker per CPU runs it, and a worker out of tests takes some queued for another
# (worksteal; the long tests left a CPU idle at the end). The kernels' OpenMP threads then
# share the CPUs with the other workers, so they wait passively rather than spin.
workers=()
if "$python" -c "import xdist" 2>/dev/null; then
    workers=(-n "$(nproc)" --dist worksteal)
    export OMP_WAIT_POLICY=passive
fi
# NumPy's array data and pyattn's scratch come from malloc, which ASan watches, whatever
# Python's own allocator. The tests of the binding itself (bad buffers handed to pyattn._core,
# argument unpacking) also run with PYTHONMALLOC=malloc, so that ASan sees the Python objects
# the binding reads; the rest keep pymalloc, under which the suite runs about a quarter faster.
binding=("$work/src/tests/test_errors.py" "$work/src/tests/test_arguments.py")
ignore=()
for f in "${binding[@]}"; do ignore+=(--ignore "$f"); done
# --capture=sys: pytest's default fd-level capture would swallow a sanitizer report written to
# fd 2 when the sanitizer ends the process; sys-level capture lets it reach the log.
run_pytest() {
    "$python" -m pytest -q -p no:cacheprovider --capture=sys "${workers[@]}" "$@" 2>&1 | tee -a "$log"
    local s=${PIPESTATUS[0]}
    # 5: nothing collected (extra arguments that select no test of this part)
    if [[ $s -eq 5 ]]; then s=0; fi
    return "$s"
}
set +e
echo "sanitize: running pytest against $so ${workers[*]}: the binding's tests (PYTHONMALLOC=malloc)"
PYTHONMALLOC=malloc run_pytest "${binding[@]}" "$@"
status=$?
echo "sanitize: running pytest against $so ${workers[*]}: the rest"
run_pytest "$work/src/tests" "${ignore[@]}" "$@"
rest=$?
if [[ $status -eq 0 ]]; then status=$rest; fi
set -e
if grep -E -q "ERROR: AddressSanitizer|runtime error:|ERROR: LeakSanitizer|SUMMARY: (Address|UndefinedBehavior)Sanitizer" "$log"; then
    echo "sanitize: FAILED: sanitizer report in the output (status $status)" >&2
    exit 1
fi
if [[ $status -ne 0 ]]; then
    echo "sanitize: FAILED: pytest exited with $status" >&2
    exit "$status"
fi
echo "sanitize: OK"
