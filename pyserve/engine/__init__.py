"""The engine: tokenizer manager, scheduler, worker thread and detokenizer on one event loop."""
