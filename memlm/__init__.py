"""memlm: retrieval- and memory-augmented language modeling.

The subpackages follow the data flow:
    data/       corpora, split expressions, documents -> token ids (one boundary rule)
    model/      config and presets, the decoder, tokenizer, weights, checkpoints
    memory/     Transformer-XL and compressive memories (states passed in and returned)
    retrieval/  the Searcher seam, exact torch search, kNN-LM math
    jobs/       windows, perplexity and kNN-LM evaluation, scoring, training
    engine/     the continuous-batching decoding engine behind generation and the servers
    cli/        the `memlm` command line on top (the only package that imports datastore and services);
                v1/ is generated protobuf code.
"""

__version__ = "0.1.0"
