"""memlm: retrieval- and memory-augmented language modeling.

Data flow: corpus -> tokenizer -> Decoder (memlm.model) -> keys/values -> datastore (FAISS)
-> Searcher -> kNN-LM (memlm.knnlm) -> perplexity jobs (memlm.evaluate) and services.
"""

__version__ = "0.1.0"
