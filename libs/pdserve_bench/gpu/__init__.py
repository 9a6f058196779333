"""The device check (``scripts/device_check.sh``): pdserve's GPU path measured on one GPU.

    python -m pdserve_bench.gpu --out report.json      (or --smoke: tiny shapes on CPU)

Parts, each recorded in the one JSON report even when another fails:
    a  greedy tokens and logits vs transformers on random-weight checkpoints with real shapes
    b  engine decode tokens/s at 1, 32, 128 sequences vs transformers ``generate``
    c  FlashInfer decode attention bandwidth at 32 x 4k tokens vs the device's copy bandwidth
    d  one disaggregated request: prefill and decode processes, KV through two kvds
"""
