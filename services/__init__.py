"""gRPC services of memlm (wire format in proto/memlm/v1, generated code in memlm.v1).

Data flow: Searcher (datastore) -> retrieval_server (RetrievalService, micro-batched) -> router
(fans out over shards) -> retrieval_client (a Searcher again, for library code). Shared pieces:
tensors (numpy <-> Tensor), security (TLS, bearer token), server_common (limits, health, shutdown).
"""
