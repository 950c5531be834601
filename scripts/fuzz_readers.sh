#!/usr/bin/env bash
# Long fuzz of k3ir's readers: the IR text parser and verifier, config.json and --set values, safetensors
# headers and HTTP request bodies (tests/*/test_fuzz_*.py) with thousands of hypothesis examples per test
# (the "fuzz-long" profile of tests/conftest.py; the suite runs the same tests with a few dozen).
# Every failure must be a k3ir.K3Error naming where (or a 4xx for HTTP bodies); hypothesis prints the
# smallest failing input and a reproduce blob. Takes tens of minutes on a laptop.
#
# usage: scripts/fuzz_readers.sh [extra pytest arguments, e.g. -k config -x]
set -euo pipefail
cd "$(dirname "$0")/.."
exec python -m pytest -q tests/*/test_fuzz_*.py --hypothesis-profile=fuzz-long "$@"
