"""The shard router: one Searcher over many retrieval replicas."""
