"""Softmax attention as a generated flash kernel: tiles of queries against tiles of keys on the
tensor cores (templates/ssmc_mma.cuh), the spec's score modifier and mask printed inline, an online
softmax in registers (docs/design/flash-attention.md); decode.py: one query a batch index
against a KV cache."""
