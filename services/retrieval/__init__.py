"""The RetrievalService: datastore search, successors, documents and memory sessions, and its client."""
