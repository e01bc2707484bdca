"""npu_bridge tests need torch (the Python 3.11 torch env); without it they are not collected.

Tiers (README "Tests"): CPU tier (unmarked, always), mocked-contract tier (``npu_contract``:
fake torch_npu / sgl_kernel_npu in a subprocess), real NPU tier (``npu``: skipped without
hardware, never counted as passed).
"""

import importlib.util

HAVE_TORCH = importlib.util.find_spec("torch") is not None

collect_ignore_glob = ["fakes/*"]
if not HAVE_TORCH:
    collect_ignore_glob += ["test_*.py"]
