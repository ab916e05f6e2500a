"""The decoding engine: continuous batching over a preallocated KV cache, per-request sampling,
kNN-LM searched once per step for every active row, and the XL memory per row."""
