#!/usr/bin/env bash
# Regenerate the checked-in Python code for proto/memlm/v1/*.proto into memlm/v1/.
#
# Generated with grpcio-tools==1.85.1 (bundled protoc; its gencode is protobuf 7.35.1, so importing the
# output needs protobuf >= 7.35.1 and grpcio >= 1.85.1). CI pins that grpcio-tools version, reruns this script and
# fails on a diff, so the output must depend only on the .proto files and the tool version: inputs are passed
# in a fixed (C-locale sorted) order, paths are relative, and stale outputs are deleted first.
#
# Why memlm/v1/: protoc's modules import each other as `memlm.v1.<name>_pb2` (from the proto
# package), which Python resolves inside our `memlm` package (DESIGN.md, "Wire format").
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-}"
if [[ -z "$PYTHON" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi

out=memlm/v1
mkdir -p "$out"
rm -f "$out"/*_pb2.py "$out"/*_pb2.pyi "$out"/*_pb2_grpc.py

mapfile -t protos < <(LC_ALL=C ls proto/memlm/v1/*.proto | LC_ALL=C sort)
"$PYTHON" -m grpc_tools.protoc \
  --proto_path=proto \
  --python_out=. \
  --pyi_out=. \
  --grpc_python_out=. \
  "${protos[@]}"
