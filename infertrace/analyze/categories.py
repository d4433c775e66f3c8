"""The kernel categories, in the order every table lists them (kernels.py sorts kernels into them). Apart from
kernels.py, which needs pandas, so that the terminal report renders without it (report_cache.py)."""

CATEGORIES = ("attention", "GEMM", "norm", "activation", "elementwise", "communication", "memcpy/memset", "other")
