"""``pdserve sim``: a discrete-event simulation of a pdserve cluster for P:D questions at scale.

    workload.py  seeded request streams: phases of a prompt/answer mix and a rate, Poisson or
                 bursty (gamma) arrivals; the shifting preset (chat → RAG → long generation)
    cluster.py   the event loop (heapq): router, prefill / decode / colocated / flex instances,
                 KV transfer from block counts and a link bandwidth; costs from the calibrated
                 ``pdserve.controller.capacity.CapacityModel``
    control.py   the controller inside the simulation (the same predictor and policy code)
    evaluate.py  fixed ratios, colocated and the controller on one workload; goodput under SLOs
    cli.py       flags, the table, JSON, the decision-trace plot
"""
