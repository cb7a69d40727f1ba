#!/usr/bin/env bash
# Coverage-guided fuzzing of everything a peer can feed us (libFuzzer via
# libfuzzer-sys, instrumented with rustc's stable sancov flags).
#
#   tests/fuzz/run.sh SECONDS     run every target, SECONDS in total
#
# Targets (tests/fuzz/fuzz_targets): wire (control messages, handshake, slot
# headers, verbs private data), frame (shm socket framing), ring (the shm
# doorbell ring under a scribbling peer), rx (the protocol state machine).
# Seeds live in tests/fuzz/corpus/<target> (small, checked in); what the
# fuzzer finds goes to a scratch corpus outside the repository. A crash
# leaves its input in target/fuzz/artifacts/<target>/ and fails the run.
# Prints one JSON row per target and one for all, and ends with the line
# `fuzz: N executions, M crashes`.
set -uo pipefail
SECONDS_TOTAL=${1:?usage: tests/fuzz/run.sh SECONDS}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
FUZZ="$ROOT/tests/fuzz"
TRIPLE=$(rustc -vV | sed -n 's/^host: //p')
export CARGO_TARGET_DIR="$ROOT/target/fuzz"
# Stable rustc: sancov instrumentation for libFuzzer's coverage feedback
# (8-bit counters, PC table, comparison tracing), checks on in release.
export RUSTFLAGS="--cfg fuzzing -Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares -Cdebug-assertions -Coverflow-checks"
TARGETS=(wire frame ring rx)
# Only the rx state machine is deep; it gets half the time.
WEIGHTS=(1 1 1 3)

echo "== building fuzz targets (${TARGETS[*]})"
(cd "$FUZZ" && cargo build --release --quiet --target "$TRIPLE" --bins) || { echo "fuzz: 0 executions, 1 crashes (build failed)"; exit 1; }

total_w=0; for w in "${WEIGHTS[@]}"; do total_w=$((total_w + w)); done
execs=0; crashes=0; all_new=0
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
for i in "${!TARGETS[@]}"; do
  t=${TARGETS[$i]}
  secs=$(( SECONDS_TOTAL * WEIGHTS[i] / total_w )); [ "$secs" -lt 1 ] && secs=1
  seeds="$FUZZ/corpus/$t"; mkdir -p "$seeds" "$work/$t" "$CARGO_TARGET_DIR/artifacts/$t"
  log="$work/$t.log"
  # The scratch corpus comes first: libFuzzer adds new inputs there only.
  timeout --kill-after=10 $((secs + 60)) "$CARGO_TARGET_DIR/$TRIPLE/release/$t" \
    -max_total_time="$secs" -print_final_stats=1 -rss_limit_mb=2048 -timeout=10 \
    -artifact_prefix="$CARGO_TARGET_DIR/artifacts/$t/" "$work/$t" "$seeds" >"$log" 2>&1
  rc=$?
  n=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  n=${n:-0}
  if [ "$rc" -ne 0 ]; then
    crashes=$((crashes + 1))
    echo "-- $t: CRASH (exit $rc); input saved under $CARGO_TARGET_DIR/artifacts/$t/"
    grep -E -A12 "panicked|ERROR: libFuzzer" "$log" | head -40
  fi
  echo "-- $t: $n executions in ${secs}s"
  # One JSON row per target (`python -m rdma_device.bench report --only
  # fuzz` gathers them): its time, executions, speed, the inputs that
  # reached new coverage, and whether it crashed.
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
  new=$(sed -n 's/^stat::new_units_added: *//p' "$log" | tail -1)
  echo "{\"target\": \"$t\", \"seconds\": $secs, \"executions\": $n, \"execs_per_s\": ${rate:-0}, \"new_units\": ${new:-0}, \"crashes\": $([ "$rc" -ne 0 ] && echo 1 || echo 0)}"
  execs=$((execs + n)); all_new=$((all_new + ${new:-0}))
done
echo "{\"target\": \"all\", \"seconds\": $SECONDS_TOTAL, \"executions\": $execs, \"execs_per_s\": $((execs / (SECONDS_TOTAL > 0 ? SECONDS_TOTAL : 1))), \"new_units\": $all_new, \"crashes\": $crashes}"
echo "fuzz: $execs executions, $crashes crashes"
[ "$crashes" -eq 0 ]
