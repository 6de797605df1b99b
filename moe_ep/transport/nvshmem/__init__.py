"""The NVSHMEM transport (one node, NVLink stores from the kernels): the runtime and its symmetric buffers
(:mod:`.runtime`), the routing layout (:mod:`.layout`), dispatch / combine (:mod:`.buffer`), the kernels' loader
(:mod:`.kernels`) and the work split (:mod:`.schedule`). Kernels: ``kernels/transport/nvshmem/``."""
