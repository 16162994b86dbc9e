"""Sources: where numbers come from.

* :mod:`gpulens.sources.nvml` - the one door to NVML (real or simulated GPUs);
* :mod:`gpulens.sources.host` - CPU and RAM through psutil;
* :mod:`gpulens.sources.torch_alloc` - torch's caching allocator, without a device sync.
"""
