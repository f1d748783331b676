#!/usr/bin/env bash
# The type check, then the whole test suite, after setting the host up (scripts/setup.sh;
# needs root).
# Real eBPF and real CRIU run here; GPU tests (tests/gpu) run where a GPU is, and are reported
# as skipped elsewhere -- a skipped GPU test is not a passed one.
#
#   scripts/test.sh                 # everything
#   scripts/test.sh -k trace -x     # any pytest arguments
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# The types first (pyproject.toml's [tool.mypy]): a type error fails the run before any test.
.venv/bin/python -m mypy
# Inside the suite a missing prerequisite (bcc, headers, nvcc) is a failure, not a skip.
export POS_REQUIRE_PREREQS=1
set +e
.venv/bin/python -m pytest -ra "$@"
rc=$?
set -e
[ "$rc" = 5 ] && { echo "test: pytest collected no tests" >&2; exit 1; }
exit "$rc"
