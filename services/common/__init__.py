"""What every memlm server shares: tensors on the wire, TLS and tokens, the circuit breaker, lifecycle."""
