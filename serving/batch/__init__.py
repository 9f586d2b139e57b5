"""Batch inference: prompts JSONL (local or gs://) to results JSONL, in shards, resumable."""
