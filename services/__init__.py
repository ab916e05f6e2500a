"""gRPC services of memlm (wire format in proto/memlm/v1, generated code in memlm.v1), one room a server.

Data flow: Searcher (datastore) -> services.retrieval (RetrievalService, micro-batched, and memory
sessions) -> services.router (fans out over shards) -> services.retrieval.client (a Searcher again, for
library code) -> services.lm (LanguageModelService) -> services.openai_front (the OpenAI-compatible HTTP
front). services.common holds what every server shares: tensors, security, circuit breaker, lifecycle.
"""
