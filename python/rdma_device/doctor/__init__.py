"""The doctor: checks that a host, and a pair of hosts, can run the
transport (``python -m rdma_device doctor``, or ``python -m
rdma_device.doctor``).

``cli``: the command line; ``host``: the checks of this host; ``pair``:
the pair test (``--listen``/``--peer``); ``checks``: the result of one
check and its printing, shared by both.
"""
