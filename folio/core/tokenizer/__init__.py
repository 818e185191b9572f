"""Output processing: incremental detokenization, stop strings, logprob text. No torch, no sockets."""
