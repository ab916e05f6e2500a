"""Generated gRPC/protobuf code for the memlm.v1 wire format (proto/memlm/v1/*.proto).

Do not edit the *_pb2*.py files: `make proto` (scripts/gen_proto.sh) regenerates them. They live here
because protoc's generated imports read `memlm.v1.<name>_pb2`, which Python resolves in this package.
"""
