#!/usr/bin/env bash
# The whole KV-cache evaluation in one device call is benchmarks/kv/gpu_kv.sh (throughput and accuracy beside every
# row, the real model, the targets; its header says what it runs and writes). This name forwards to it, for the
# commands that still use it.
exec bash "$(dirname "$0")/gpu_kv.sh" "$@"
