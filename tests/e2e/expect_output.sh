#!/usr/bin/env bash
# Runs a command and passes only when it exits 0 AND its output has a line matching an
# extended regular expression (CTest's PASS_REGULAR_EXPRESSION alone ignores the exit status).
# usage: expect_output.sh REGEX -- COMMAND [ARGS...]
set -u
regex="$1"; shift
[ "${1:-}" = "--" ] && shift
out=$(mktemp); trap 'rm -f "$out"' EXIT
"$@" > "$out" 2>&1
rc=$?
cat "$out"
[ "$rc" -eq 0 ] || { echo "FAIL: exit status $rc"; exit 1; }
grep -Eq -- "$regex" "$out" || { echo "FAIL: no line of the output matches: $regex"; exit 1; }
