#!/usr/bin/env bash
# The layers' include rules (docs/architecture.md, Layers): base/ includes nothing of the
# project outside base/; data/ and models/ include nothing from partial_fc/ (only base/);
# partial_fc/ includes nothing from data/, models/ or app/. Each include that breaks a rule
# is printed with its file and line.
# usage: layout_rules.sh SOURCE_DIR
set -u
cd "$1" || exit 2
bad=0
rule() {  # rule WHAT FOLDERS... -- PATTERN
  local what="$1"; shift
  local dirs=()
  while [ "$1" != "--" ]; do dirs+=("$1"); shift; done
  shift
  local hits
  hits=$(grep -rnE --include='*.h' --include='*.cpp' --include='*.cu' "^#include \"($1)" "${dirs[@]}")
  if [ -n "$hits" ]; then echo "FAIL: $what:"; echo "$hits"; bad=1; fi
  # The folders must exist and hold sources, or the rule holds vacuously.
  for d in "${dirs[@]}"; do
    [ -n "$(find "$d" -name '*.cpp' | head -1)" ] || { echo "FAIL: $d holds no sources"; bad=1; }
  done
}
rule "base/ includes the project's other folders" base -- "partial_fc/|data/|models/|app/|tools/|tests/"
rule "data/ or models/ includes partial_fc/" data models -- "partial_fc/|app/"
rule "partial_fc/ includes data/, models/ or app/" partial_fc -- "data/|models/|app/"
[ "$bad" = 0 ] && echo "layout: base/, data/, models/ and partial_fc/ keep their include rules"
exit "$bad"
