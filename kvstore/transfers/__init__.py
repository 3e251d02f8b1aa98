"""The daemon's side of moving blocks between nodes: remote fetch, the peer store, the
prefill → decode handoff and the conversations peers start. It owns the tier manager's
slots and the index lookups; ``kvstore.transport`` below it only moves bytes between the
buffers and addresses it is handed."""
